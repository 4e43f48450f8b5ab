#!/usr/bin/env bash
# Qwen3-8B (dense) as Megatron-LM configures it (examples/post_training/modelopt/conf/qwen/Qwen3-8B.sh),
# scaled down for a CPU: 4 layers, hidden 64, grouped queries with per-head query and key norms, the
# vocabulary padded to a multiple of 64 (1187 there, for Qwen's tokenizer). Every other flag is the
# recipe's (its dropout is Megatron-LM's default, 0.1), plus --pipeline-schedule chimera
# and a pipeline (common.sh); no experts, so no expert parallelism (EP=1) and 2 processes.
EP=${EP:-1}
NPROC=${NPROC:-2}
source "$(dirname "$0")/common.sh"
MODEL_ARGS=(
    --save-interval 100000 --micro-batch-size 1 --no-masked-softmax-fusion --disable-bias-linear
    --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm
    --swiglu --num-layers 4 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 8
    --group-query-attention --num-query-groups 2 --kv-channels 16 --qk-layernorm
    --seq-length 64 --max-position-embeddings 640 --make-vocab-size-divisible-by 64 --use-mcore-models
    --rotary-percent 1.0 --rotary-base 1000000 --no-bias-swiglu-fusion
)
TRAINING_ARGS=(--global-batch-size 8 --lr 1e-4 --train-iters 10 --min-lr 1e-5 --clip-grad 1.0 --log-interval 1
               --eval-iters 2 --eval-interval 5)
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
