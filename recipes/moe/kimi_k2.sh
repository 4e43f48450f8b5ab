#!/usr/bin/env bash
# Kimi-K2 as Megatron-LM configures it (examples/post_training/modelopt/conf/moonshotai/Kimi-K2-Instruct.sh),
# scaled down for a CPU: 4 layers (the first dense), hidden 64, 8 experts of which 2 routed plus a shared
# one overlapped with the dispatch (on the CPU without overlap: the same result, said at startup),
# sigmoid routing with expert bias, multi-latent attention with YaRN-scaled RoPE, the vocabulary padded to
# --padded-vocab-size, activations and MoE layers recomputed. Every other flag is the recipe's (its dropout
# is Megatron-LM's default, 0.1), plus --pipeline-schedule chimera and a pipeline (common.sh). The recipe's
# --trust-remote-code and HuggingFace tokenizer stand aside for common.sh's SentencePiece tokenizer.
source "$(dirname "$0")/common.sh"
MODEL_ARGS=(
    --save-interval 100000 --micro-batch-size 1 --no-masked-softmax-fusion --disable-bias-linear
    --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm
    --swiglu --num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --kv-channels 16
    --multi-latent-attention --kv-lora-rank 32 --v-head-dim 16 --q-lora-rank 32 --qk-head-dim 16 --qk-layernorm
    --qk-pos-emb-head-dim 8
    --num-experts 8 --moe-layer-freq "[0]*1+[1]*3" --moe-ffn-hidden-size 32 --moe-router-dtype fp32
    --moe-router-score-function sigmoid --moe-router-bias-update-rate 1e-3 --moe-router-enable-expert-bias
    --moe-router-topk 2 --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.827 --moe-shared-expert-overlap
    --moe-shared-expert-intermediate-size 32 --moe-aux-loss-coeff 1e-4 --moe-router-load-balancing-type seq_aux_loss
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs
    --seq-length 64 --max-position-embeddings 2048 --make-vocab-size-divisible-by 1 --use-mcore-models
    --rotary-base 50000 --rotary-percent 1.0 --rotary-scaling-factor 32 --mscale 1.0 --mscale-all-dim 1.0
    --padded-vocab-size 1280 --recompute-activations --moe-layer-recompute --sequence-parallel
)
TRAINING_ARGS=(--global-batch-size 8 --lr 1e-4 --train-iters 10 --min-lr 1e-5 --clip-grad 1.0 --log-interval 1
               --eval-iters 2 --eval-interval 5)
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
