#!/usr/bin/env bash
# gpt-oss as Megatron-LM trains it (examples/gptoss/02_train.sh, its bf16 variant: the FP8 flags aside),
# scaled down for a CPU: 4 layers, hidden 64, 4 experts of which 2 routed, sliding-window attention (a
# 16-token window, the recipe's 128 scaled to the 64-token sequence) on every other layer, learnable
# attention sinks (--softmax-type learnable), gpt-oss's clamped GLU (--quick-geglu --glu-linear-offset 1.0
# --activation-func-clamp-value 7.0), mock data with Megatron-LM's NullTokenizer, as the recipe's default.
# Its two flags that only Megatron-LM's ModelOpt parser defines (--export-force-local-attention,
# --enable-gpt-oss) stand aside. Checkpoints go to CHECKPOINTS (default: none saved). Plus
# --pipeline-schedule chimera, a pipeline and expert parallelism (common.sh). Train on with --train-samples.
source "$(dirname "$0")/common.sh"
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --tiktoken-pattern v2 --split 99,1,0
           --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1)
CHECKPOINT_ARGS=()
[ -n "${CHECKPOINTS:-}" ] && CHECKPOINT_ARGS=(--save "$CHECKPOINTS" --tensorboard-dir "$CHECKPOINTS/tensorboard")
MODEL_ARGS=(
    --no-masked-softmax-fusion --transformer-impl transformer_engine --disable-bias-linear
    --untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm --num-layers 4 --hidden-size 64
    --ffn-hidden-size 128 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --seq-length 64
    --max-position-embeddings 64 --use-mcore-models --rotary-percent 1.0 --rope-type rope
    --position-embedding-type rope --rotary-base 10000 --no-bias-gelu-fusion --no-bias-dropout-fusion --quick-geglu
    --glu-linear-offset 1.0 --softmax-type learnable --window-attn-skip-freq 2 --activation-func-clamp-value 7.0
    --window-size 16,0
)
MOE_ARGS=(
    --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
    --moe-ffn-hidden-size 128 --moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 --moe-permute-fusion
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 8 --lr 1.0e-5 --train-samples 80 --lr-decay-samples 78
    --lr-decay-style cosine --min-lr 1.0e-6 --weight-decay 0.1 --lr-warmup-fraction 0.05 --clip-grad 1.0
    --use-flash-attn --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32
    --disable-bf16-reduced-precision-matmul --recompute-activations
)
PARALLEL_ARGS+=(--tensor-model-parallel-size 1 --sequence-parallel --context-parallel-size 1
               --use-distributed-optimizer)
LOGGING_ARGS=(--log-interval 1 --save-interval 10000 --eval-interval 50000000 --eval-iters 0 --moe-per-layer-logging
              --no-load-optim --no-load-rng --log-throughput)
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "$@"
