#!/usr/bin/env bash
# DeepSeek-V2-Lite as Megatron-LM core_v0.19 configures it
# (examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh), scaled down for a CPU:
# 4 layers (the first dense), hidden 64, 8 experts of which 2 routed plus a shared one, multi-latent
# attention with 32-wide latents. One flag added for the CPU: --q-lora-rank (DeepSeek-V2 and V3 set it; V2-Lite
# normalises its query inside Transformer Engine's fused norm-and-projection, which megatron-core's local
# layers lack). Every other flag is the recipe's, plus --pipeline-schedule chimera.
source "$(dirname "$0")/common.sh"
MODEL_ARGS=(
    --attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 1 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --kv-channels 16
    --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 32 --v-head-dim 16 --qk-head-dim 16 --qk-layernorm
    --qk-pos-emb-head-dim 8
    --num-experts 8 --moe-layer-freq "([0]+[1]*3)" --moe-ffn-hidden-size 32 --moe-grouped-gemm
    --moe-router-score-function softmax --moe-router-topk 2 --moe-router-topk-scaling-factor 1.0
    --moe-router-pre-softmax --moe-shared-expert-intermediate-size 64 --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs --moe-router-load-balancing-type seq_aux_loss
    --seq-length 64 --max-position-embeddings 64 --attention-softmax-in-fp32 --use-mcore-models
    --rotary-percent 1.0 --rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707
    --sequence-parallel
)
TRAINING_ARGS=(--global-batch-size 8 --lr 1e-4 --train-iters 10 --min-lr 1e-5 --weight-decay 0.1 --clip-grad 1.0
               --log-interval 1 --eval-iters 2 --eval-interval 5)
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
