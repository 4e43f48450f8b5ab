#!/usr/bin/env bash
# Qwen3-235B-A22B as Megatron-LM configures it (examples/post_training/modelopt/conf/qwen/
# Qwen3-235B-A22B.sh), scaled down for a CPU: 4 layers, hidden 64, 16 experts of which 4 routed, grouped
# queries with per-head query and key norms, every MoE layer recomputed, RoPE with a sequence-length
# interpolation factor (1, as the recipe sets it), the vocabulary padded to a multiple of 64 (1187 there,
# for Qwen's tokenizer). Every other flag is the recipe's, plus
# --pipeline-schedule chimera and a pipeline (common.sh).
source "$(dirname "$0")/common.sh"
MODEL_ARGS=(
    --save-interval 100000 --micro-batch-size 1 --no-masked-softmax-fusion --disable-bias-linear
    --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm
    --swiglu --num-layers 4 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 8
    --group-query-attention --num-query-groups 2 --kv-channels 16 --qk-layernorm
    --num-experts 16 --moe-ffn-hidden-size 32 --moe-router-topk 4 --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-layer-recompute
    --seq-length 64 --max-position-embeddings 640 --make-vocab-size-divisible-by 64 --use-mcore-models
    --rotary-percent 1.0 --rotary-base 1000000 --rotary-seq-len-interpolation-factor 1 --no-bias-swiglu-fusion
    --attention-dropout 0.0 --hidden-dropout 0.0 --sequence-parallel
)
TRAINING_ARGS=(--global-batch-size 8 --lr 1e-4 --train-iters 10 --min-lr 1e-5 --clip-grad 1.0 --log-interval 1
               --eval-iters 2 --eval-interval 5)
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
