#!/usr/bin/env bash
# DeepSeek-V3 as Megatron-LM trains it (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh, its training
# flags; the Megatron-FSDP block, the Slurm wrapper, profiling and Weights & Biases aside), scaled down for a
# CPU: 8 layers (the first three dense), hidden 64, 16 experts of which 4 routed within 2 of 4 groups plus
# a shared one, sigmoid routing with expert bias, forced load balancing (random routing, as the recipe
# benchmarks it), multi-latent attention with YaRN-scaled RoPE, one multi-token-prediction layer, selective
# recomputation of the MLP, MoE, MLA up-projection and norm modules, no NaN check, lenient checkpoint loading.
# What differs from the recipe: --moe-token-dispatcher-type alltoall for its flex dispatcher (HybridEP, GPU
# kernels); the data, common.sh's SentencePiece tokenizer on mock data for DeepSeek-V3's tokenizer and
# corpus, its vocabulary padded to a multiple of 64 (3232 there); the FSDP block, --calculate-per-token-loss
# included. Checkpoints and TensorBoard go to CHECKPOINTS (default: none written). Plus --pipeline-schedule
# chimera and a pipeline (common.sh). Train on with --train-samples (the recipe counts samples, not iterations).
# Its forced load balancing routes by random logits that megatron-core draws per expert-parallel rank, by
# design: so its losses follow the layout, in Megatron-LM as here; without that flag this recipe in fp32
# prints one process's losses to the digit.
source "$(dirname "$0")/common.sh"
CHECKPOINT_ARGS=()
DATA_ARGS=(--tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL" --mock-data --split 99,1,0)
[ -n "${CHECKPOINTS:-}" ] && CHECKPOINT_ARGS=(--load "$CHECKPOINTS" --save "$CHECKPOINTS" --save-interval 100
                                            --tensorboard-dir "$CHECKPOINTS/tensorboard")
MODEL_ARGS=(
    --distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-tensor-parallel-size 1
    --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear --micro-batch-size 1
    --global-batch-size 8 --train-samples 80 --exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad
    --manual-gc --manual-gc-interval 10 --recompute-granularity selective
    --recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine --seq-length 64
    --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6
    --num-layers 8 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --kv-channels 16
    --max-position-embeddings 64 --position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 64
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
    --multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1
    --qk-layernorm --lr-decay-samples 78 --lr-warmup-samples 8 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7
    --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
    --num-experts 16 --moe-layer-freq "[0]*3+[1]*5" --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
    --moe-router-load-balancing-type seq_aux_loss --moe-router-topk 4 --moe-token-dispatcher-type alltoall
    --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2
    --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
    --moe-router-force-load-balancing
    --q-lora-rank 32 --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
    --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --eval-iters 2 --eval-interval 5 --auto-detect-ckpt-format --dist-ckpt-strictness log_all
    --init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad
    --log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40
    --enable-experimental
)
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
