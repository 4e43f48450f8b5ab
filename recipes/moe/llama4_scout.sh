#!/usr/bin/env bash
# Llama 4 Scout (17B, 16 experts) as Megatron-LM configures it (examples/post_training/modelopt/conf/
# meta-llama/Llama-4-Scout-17B-16E-Instruct.sh), scaled down for a CPU: 4 layers, hidden 64, 8 experts
# with top-1 sigmoid routing plus a shared expert, grouped queries with query and key norms, interleaved
# RoPE with Llama's frequency scaling (--use-rope-scaling --rope-scaling-factor 8), the vocabulary padded
# to --padded-vocab-size (202048 there, 640 here). Every other flag is the
# recipe's (its dropout is Megatron-LM's default, 0.1), plus --pipeline-schedule chimera and a pipeline
# (common.sh); its two --export-* flags, which only Megatron-LM's ModelOpt parser defines, stand aside.
source "$(dirname "$0")/common.sh"
MODEL_ARGS=(
    --save-interval 100000 --micro-batch-size 1 --no-masked-softmax-fusion --disable-bias-linear
    --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm
    --swiglu --num-layers 4 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 8
    --group-query-attention --num-query-groups 2 --qk-layernorm
    --num-experts 8 --moe-ffn-hidden-size 64 --moe-router-score-function sigmoid --moe-router-topk 1
    --moe-router-topk-scaling-factor 1.0 --moe-router-dtype fp32 --moe-shared-expert-intermediate-size 64
    --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs
    --moe-router-load-balancing-type seq_aux_loss
    --seq-length 64 --max-position-embeddings 64 --make-vocab-size-divisible-by 128 --use-mcore-models
    --rotary-interleaved --rotary-percent 1.0 --rotary-base 500000 --rope-scaling-factor 8.0 --use-rope-scaling
    --padded-vocab-size 640
    --sequence-parallel --no-bias-swiglu-fusion
)
TRAINING_ARGS=(--global-batch-size 8 --lr 1e-4 --train-iters 10 --min-lr 1e-5 --clip-grad 1.0 --log-interval 1
               --eval-iters 2 --eval-interval 5)
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
