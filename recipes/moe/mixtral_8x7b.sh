#!/usr/bin/env bash
# Mixtral 8x7B as Megatron-LM core_v0.19 trains it (examples/mixtral/train_mixtral_8x7b_distributed.sh),
# scaled down for a CPU: 4 layers, hidden 64, 8 experts of which 2 routed. Every other flag is the
# recipe's (the distributed optimizer with overlapped reduce and gather, the alltoall dispatcher, expert
# parallelism), plus --pipeline-schedule chimera and a pipeline (common.sh).
source "$(dirname "$0")/common.sh"
MODEL_ARGS=(
    --use-mcore-models --disable-bias-linear --seq-length 64 --max-position-embeddings 256
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --init-method-std 0.01
    --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
    --no-position-embedding --rotary-base 1000000
)
MOE_ARGS=(
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 10 --min-lr 1.0e-5
               --weight-decay 0.1 --clip-grad 1.0 --log-interval 1 --eval-iters 2 --eval-interval 5)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --use-distributed-optimizer --sequence-parallel)
LOGGING_ARGS=(--no-load-optim --no-load-rng)
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
