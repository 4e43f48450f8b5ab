"""Every option string Megatron-LM's parser defines, in exactly one class.

- **honoured**: the same effect as in Megatron-LM (``VALUES`` narrows a few to the values we run);
- **no effect**: accepted and ignored, for the reason given (a GPU-only fusion on the CPU, a log
  series we do not write, a deprecated spelling of our default);
- **refused**: a value other than Megatron-LM's default fails before anything starts, in one line
  naming the flag and the reason.

``tests/unit/test_flag_classes.py`` fails when the installed Megatron-LM defines a flag that is in none
of these (or in two), so a new megatron-core release cannot slip flags past us;
``python -m megatron.chimera.config.flag_table`` writes the table ``docs/flags.md`` from these.
"""
from __future__ import annotations


def _flags(text: str) -> frozenset[str]:
    return frozenset(text.split())


# megatron-core's flex dispatcher's settings: honoured where it runs, on a GPU with its backend's kernels
# (architecture_rules.py refuses --moe-token-dispatcher-type flex elsewhere, naming them)
FLEX_DISPATCHER = _flags("""
    --moe-enable-deepep --moe-flex-dispatcher-backend --moe-permute-fusion-into-hybridep
    --moe-hybridep-pad-uneven-dispatch-inputs --moe-flex-dispatcher-num-sms --moe-deepep-num-sms
    --moe-hybridep-num-sms --moe-hybridep-num-blocks-permute --moe-hybridep-num-blocks-unpermute
    --moe-hybridep-num-sms-preprocessing --moe-ncclep-static-shape --moe-ncclep-zero-copy
""")
HONOURED = FLEX_DISPATCHER | _flags("""
    --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
    --decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers --pipeline-model-parallel-layout
    --mtp-num-layers --mtp-loss-scaling-factor
    --help --tensor-model-parallel-size --pipeline-model-parallel-size --sequence-parallel --fp16 --bf16
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl --num-layers --hidden-size --num-attention-heads
    --attention-backend --num-query-groups --ffn-hidden-size --kv-channels --hidden-dropout
    --attention-dropout --apply-residual-connection-post-layernorm --norm-epsilon --apply-layernorm-1p
    --disable-bias-linear --add-qkv-bias --rotary-interleaved --normalization --qk-layernorm
    --calculate-per-token-loss --init-method-std --recompute-granularity --recompute-method
    --recompute-num-layers --transformer-impl --group-query-attention --max-position-embeddings
    --position-embedding-type --use-rotary-position-embeddings --rotary-base --rotary-percent
    --no-position-embedding --make-vocab-size-divisible-by --swiglu --untie-embeddings-and-output-weights
    --weight-decay --clip-grad --adam-beta1 --adam-beta2 --adam-eps --profile --profile-step-start
    --profile-step-end --use-pytorch-profiler --profile-ranks --micro-batch-size --global-batch-size
    --rampup-batch-size --step-batch-size-schedule --decrease-batch-size-if-needed --eval-global-batch-size
    --eval-micro-batch-size --rerun-mode --error-injection-rate --error-injection-type --check-for-spiky-loss
    --check-for-large-grads --result-rejected-tracker-filename
    --empty-unused-memory-level --train-iters --train-samples --exit-interval --exit-duration-in-mins
    --exit-signal-handler --exit-signal --manual-gc --manual-gc-interval --no-manual-gc-eval
    --disable-manual-gc-eval --recompute-activations --optimizer --dataloader-type --seed --lr-decay-style
    --lr-decay-iters --lr-decay-samples --lr-warmup-fraction --lr-warmup-iters --lr-warmup-samples
    --lr-warmup-init --override-opt_param-scheduler --override-opt-param-scheduler
    --use-checkpoint-opt_param-scheduler --use-checkpoint-opt-param-scheduler --start-weight-decay
    --end-weight-decay --weight-decay-incr-style --lr --min-lr --decoupled-lr --decoupled-min-lr --save
    --save-interval --persistent-save-interval --load --finetune --exit-on-missing-checkpoint --ckpt-format
    --async-save --use-persistent-ckpt-worker --save-retain-interval --use-checkpoint-args
    --no-use-tokenizer-model-from-checkpoint-args --disable-use-tokenizer-model-from-checkpoint-args
    --no-load-optim --no-load-rng --loss-scale --initial-loss-scale --min-loss-scale --loss-scale-window
    --hysteresis --distributed-backend --distributed-timeout-minutes --num-layers-per-virtual-pipeline-stage
    --num-virtual-stages-per-pipeline-rank --overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer
    --num-distributed-optimizer-instances --use-tp-pp-dp-mapping
    --muon-momentum --muon-no-split-qkv --muon-nesterov --muon-scale-mode --muon-fp32-matmul-prec
    --muon-coefficient-type --muon-num-ns-steps --muon-tp-mode --muon-extra-scale-factor --muon-scalar-optimizer
    --eval-iters
    --eval-interval --data-path --split --data-cache-path --no-mmap-bin-files --mock-data --seq-length --num-workers
    --reset-position-ids --eod-mask-loss --vocab-size --vocab-file --merge-file --tokenizer-type
    --tokenizer-model --fim-data --fim-rate --fim-spm-rate --fim-split-sample --fim-fragment-rate --fim-no-prefix
    --fim-prefix-token --fim-middle-token --fim-suffix-token --fim-pad-token --fim-eod-token
    --log-interval --log-throughput --timing-log-level --timing-log-option --tensorboard-dir
    --no-barrier-with-level-1-timing --nvtx-ranges
    --log-params-norm --log-num-zeros-in-grad --tensorboard-log-interval --tensorboard-queue-size
    --log-timers-to-tensorboard --log-memory-to-tensorboard --log-validation-ppl-to-tensorboard
    --log-world-size-to-tensorboard --no-log-loss-scale-to-tensorboard --disable-log-loss-scale-to-tensorboard
    --wandb-project --wandb-exp-name --wandb-save-dir --wandb-entity --logging-level
    --num-experts --moe-ffn-hidden-size --moe-router-topk --moe-layer-freq --moe-router-load-balancing-type
    --moe-aux-loss-coeff --moe-z-loss-coeff --moe-token-dispatcher-type --moe-router-score-function
    --moe-router-pre-softmax --moe-router-topk-scaling-factor --moe-router-num-groups --moe-router-group-topk
    --moe-router-dtype --moe-shared-expert-intermediate-size --moe-expert-capacity-factor --moe-token-drop-policy
    --moe-pad-expert-input-to-capacity --expert-model-parallel-size --expert-tensor-parallel-size
    --moe-router-enable-expert-bias --moe-router-bias-update-rate --moe-layer-recompute
    --recompute-modules --moe-shared-expert-overlap --moe-shared-expert-gate --moe-router-force-load-balancing
    --no-check-for-nan-in-loss-and-grad --dist-ckpt-strictness --trust-remote-code
    --check-weight-hash-across-dp-replicas-interval
    --multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim
    --rotary-scaling-factor --mscale --mscale-all-dim --rope-type --moe-grouped-gemm --attention-softmax-in-fp32
    --overlap-moe-expert-parallel-comm
    --no-gradient-accumulation-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion
    --no-rope-fusion --no-masked-softmax-fusion --no-persist-layer-norm --moe-permute-fusion --moe-router-fusion
    --rotary-seq-len-interpolation-factor --use-rope-scaling --rope-scaling-factor --padded-vocab-size
    --window-size --window-attn-skip-freq --softmax-type --quick-geglu --glu-linear-offset
    --activation-func-clamp-value --enable-experimental --disable-bf16-reduced-precision-matmul
    --deterministic-mode --apply-query-key-layer-scaling --attention-output-gate --squared-relu --qk-l2-norm
    --embedding-init-method-std --no-rope-freq --apply-wd-to-qk-layernorm
    --no-weight-decay-cond-type --te-rng-tracker
    --verify-integrity --disable-gloo-process-groups --no-save-optim
    --context-parallel-size --cp-comm-type --hierarchical-context-parallel-sizes
""")

NO_EFFECT = {
    ("Muon's layer-wise distributed optimizer keeps every parameter whole, AdamW's too (the path this flag asks "
     "for; AdamW steps each element alike either way)"): _flags("""
        --no-use-layer-wise-param-layout
    """),
    ("inference with CUDA graphs only (megatron-core's text-generation controller pads the experts); training "
     "never reads it"): _flags("""
        --moe-pad-experts-for-cuda-graph-inference
    """),
    ("megatron-core's interleaved schedule's grouping of micro-batches per virtual stage: --pipeline-schedule "
     "megatron-interleaved passes it to megatron-core, which honours it; our schedules' orders are their "
     "generators' (chimera_schedules/registry.py), in which no such group exists"): _flags("""
        --microbatch-group-size-per-virtual-pipeline-stage
    """),
    ("with --overlap-param-gather each stage copy's weight gather starts right after the optimizer step, and "
     "its next forward waits for it; starting the gathers bucket by bucket inside the step (megatron-core's "
     "way) changes when they start, not what any rank computes"): _flags("""
        --overlap-param-gather-with-optimizer-step
    """),
    'weights are always drawn on the CPU (so every copy of a stage starts equal)': _flags("""
        --use-cpu-initialization
    """),
    'a log series or report this trainer does not write; training is unaffected': _flags("""
        --config-logger-dir --log-progress --log-memory-interval --log-device-memory-used --log-energy
        --no-one-logger --one-logger-project --one-logger-run-name --one-logger-async --app-tag-run-name
        --app-tag-run-version
    """),
    ('per-layer MoE values: the iteration line and TensorBoard carry the means over the MoE layers (the '
     'routers number their layers within a stage)'): _flags("""
        --moe-per-layer-logging
    """),
    "a fused GPU kernel; the CPU path and megatron-core's local layer spec run without it": _flags("""
        --use-flash-attn --disable-jit-fuser
    """),
    "models are always megatron-core's": _flags("""
        --use-mcore-models
    """),
    'loading always detects the checkpoint format': _flags("""
        --auto-detect-ckpt-format
    """),
    'deprecated in Megatron-LM: torch_dist is the default format and every rank writes its own shards': _flags("""
        --no-ckpt-fully-parallel-save --use-dist-ckpt --ckpt-fully-parallel-save
    """),
    'gradients always accumulate and reduce in fp32 here': _flags("""
        --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32
    """),
    "torchrun's LOCAL_RANK picks the device": _flags("""
        --local-rank
    """),
    'no attention mask is built: attention is causal': _flags("""
        --no-create-attention-mask-in-dataloader
    """),
    'applies to the TikTokenizer, which is refused': _flags("""
        --tiktoken-pattern --tiktoken-num-special-tokens
    """),
    'the Multi-Storage Client is off by default': _flags("""
        --disable-msc
    """),
    ("how torch_dist files are written or read (in parallel, by how many threads, with which process group): "
     "every rank writes and reads its own shards, and the files hold the same either way"): _flags("""
        --ckpt-fully-parallel-load --ckpt-fully-parallel-load-exchange-algo --ckpt-assume-constant-structure
        --dist-ckpt-workers --ckpt-fully-parallel-save-process-group --ckpt-fully-parallel-load-process-group
    """),
    ("which asynchronous writer --async-save uses and at what priority: megatron-core's (mcore), a process forked "
     "per save at the trainer's priority; nvidia-resiliency-ext's (nvrx) and the persistent worker's priorities "
     "write the same files"): _flags("""
        --async-strategy --async-ckpt-cpu-priority --async-ckpt-io-priority --async-ckpt-use-cpu-shm
    """),
    ("the optimizer state is always written whole, sharded like the parameters (Megatron's fully reshardable "
     "format): it loads at any DP, TP, PP, layout and schedule, with or without the distributed optimizer"): _flags("""
        --dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient
    """),
    'gradients are reduced per stage copy, not in DDP buckets': _flags("""
        --ddp-bucket-size --ddp-num-buckets --ddp-pad-buckets-for-high-nccl-busbw
    """),
    "defined by Megatron-LM 0.19 but read nowhere in it (GELU stays torch's)": _flags("""
        --openai-gelu --onnx-safe
    """),
    ("every copy's weights are drawn from --seed and the parameter's name, so the data-parallel copies start "
     "equal, as Megatron-LM's broadcast from DP rank 0 leaves them under this flag (the per-DP-rank seed "
     "offset it also gives dropout is not applied)"): _flags("""
        --data-parallel-random-init
    """),
    ("megatron-core's real-time check compares the query and key norms across data-parallel ranks inside "
     "attention's forward, a collective outside the proven schedule; here every copy of a weight takes the "
     "same reduced update (the equivalence tests check the copies bitwise)"): _flags("""
        --test-mode
    """),
    ("how megatron-core's interleaved 1F1B overlaps its p2p: megatron-core's schedules here always batch "
     "theirs (what --no-overlap-p2p-communication asks), and our executor posts every receive ahead of "
     "need (chimera_schedules/passes/lowering.py)"): _flags("""
        --no-overlap-p2p-communication --overlap-p2p-communication-warmup-flush
    """),
    ("where megatron-core's 1F1B computes the output layer's weight gradient (deferred to the flush, with "
     "gradient-accumulation fusion); ours computes it in the backward (in W under --split-backward): the "
     "same gradient"): _flags("""
        --defer-embedding-wgrad-compute --wgrad-deferral-limit
    """),
    ("gradients are summed over data-parallel replicas, then divided by their number (after the "
     "reduction: neither before it, Megatron-LM's default, nor inside it, this flag's); the same mean, "
     "to rounding (bitwise when DP is a power of two)"): _flags("""
        --ddp-average-in-collective
    """),
}

REFUSED = {
    'a data-parallel or process-group option this trainer does not implement': _flags("""
        --tensor-parallel-num-weight-shards --no-initialization --no-align-grad-reduce
        --disable-align-grad-reduce --lazy-mpu-init --nccl-communicator-config-path
        --use-sharp --sharp-enabled-group --high-priority-stream-groups
        --distributed-timeout-seconds-after-init --flight-recorder-dump-path
        --flight-recorder-trace-buffer-size --no-flight-recorder-dump-on-timeout
        --disable-flight-recorder-dump-on-timeout --flight-recorder-include-stack-trace
        --no-flight-recorder-include-only-active --disable-flight-recorder-include-only-active
        --no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-extra-dump-on-exec
        --model-parallel-size
        --ddp-reduce-scatter-with-fp32-accumulation --ddp-param-name-patterns-for-fp32-local-accumulation
          --no-align-param-gather
        --use-nccl-ub --disable-symmetric-registration
        --create-all-gather-group --no-gradient-reduce-div-fusion 
        --fake-process-group
    """),
    "the pipeline schedule is --pipeline-schedule's, run by one executor": _flags("""
        --pipeline-model-parallel-comm-backend --delay-wgrad-compute --use-ring-exchange-p2p
          
         --encoder-num-layers --decoder-num-layers
         --encoder-seq-length
        --decoder-seq-length
    """),
    ("hybrid (dynamic) context parallelism's bound on the tokens per DP x CP rank: --hybrid-context-parallel "
     "is not supported (context parallelism itself is: --context-parallel-size)"): _flags("""
        --max-seqlen-per-dp-cp-rank
    """),
    ("GPU-only: Qwen3-Next's gated delta net (and DSA: see --dsa-kernel-backend) needs flash-linear-attention on a "
     "GPU: megatron-core 0.19's GatedDeltaNet fails without fla, allocates on torch.cuda.current_device() and "
     "normalises with fla's Triton l2norm (its torch fallback covers the convolution and delta rule only); not "
     "supported yet"): _flags("""
        --experimental-attention-variant --linear-attention-freq
        --linear-conv-kernel-dim --linear-key-head-dim --linear-value-head-dim --linear-num-key-heads
        --linear-num-value-heads
    """),
    ("GPU-only: DeepSeek's sparse attention (DSA) needs GPU kernels: its fused indexer and attention are TileLang's "
     "or cuDNN's (--dsa-kernel-backend), its block spec is Transformer Engine's only; not supported yet"): _flags("""
        --dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk --dsa-indexer-topk-freq
        --dsa-indexer-skip-topk-offset --dsa-indexer-loss-coeff --dsa-indexer-use-sparse-loss
        --dsa-kernel-backend --dsa-indexer-rope-interleaved --no-dsa-indexer-rotate-activation
        --disable-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu
        --disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32
    """),
    "GPT models with megatron-core's standard attention only": _flags("""
        --hybrid-context-parallel --is-hybrid-model --mamba-state-dim --mamba-head-dim --mamba-num-groups
        --mamba-num-heads --disable-mamba-mem-eff-path --mlp-chunks-for-prefill --mlp-chunks-for-training
        --mamba-training-ssm-states-dtype
        --cache-mla-latents --mla-down-proj-fusion --heterogeneous-layers-config-path
        --heterogeneous-layers-config-encoded-json --mamba-inference-conv-states-dtype
        --mamba-inference-ssm-states-dtype --spec --hybrid-layer-pattern
        --hybrid-override-pattern
    """),
    ('this part of mixture-of-experts training is not supported yet (overlaps, routing replay and quantisation '
     'padding, latent MoE, upcycling)'): _flags("""
        --expert-tensor-parallel-num-weight-shards
        --overlap-dispatch-backward-with-experts-wgrad
        --ep-overlap-early-attn-memory-release --high-priority-a2a-comm-stream
        --use-grouped-gemm-for-shared-expert --moe-shared-expert-glu-interleave-size
        --moe-enable-routing-replay --moe-router-padding-for-quantization --moe-router-padding-for-fp8
        --moe-router-quantile-balancing-ema
        --moe-router-force-biased --use-grouped-gemm-for-dense-mlp
        --moe-single-grouped-weight --moe-single-grouped-bias --moe-input-jitter-eps
        
        --moe-apply-probs-on-input --moe-latent-size --moe-mlp-glu-interleave-size --moe-expert-rank-capacity-factor
        --moe-paged-stash
        --moe-paged-stash-page-size --moe-paged-stash-buffer-size-factor-cuda
        --moe-paged-stash-buffer-size-factor-cpu --moe-use-upcycling --moe-upcycling-granularity
        --moe-routing-trace-path --moe-routing-trace-max-training-iters --moe-routing-trace-capture-logits
        --moe-routing-trace-capture-hidden-states --moe-routing-trace-dump-weights
    """),
    'a model, precision or initialisation variant this trainer does not implement yet': _flags("""
         --flash-attention-version --fp32-residual-connection
         --qk-clip --qk-clip-alpha
        --qk-clip-threshold  
        
        --use-fused-weighted-squared-relu --fused-residual-rmsnorm 
        --distribute-saved-activations --no-clone-scatter-output-in-embedding
        --disable-clone-scatter-output-in-embedding --use-te-activation-func --mrope-section
        --yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow
        --yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int
        --relative-attention-num-buckets --relative-attention-max-distance
        
           
          
         --freeze-all-layers --fp16-lm-cross-entropy
        --no-pad-vocab-size --disable-pad-vocab-size --log-max-attention-logit
    """),
    ("GPU-only: Transformer Engine's tensor-parallel communication overlap (its userbuffers) needs GPUs; not "
     "supported yet"): _flags("""
        --tp-comm-overlap --no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad
        --disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag
        --no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag
        --disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs
        --tp-comm-bootstrap-backend --tp-comm-overlap-cfg
    """),
    'these multi-token prediction variants are not supported yet (--mtp-num-layers is)': _flags("""
        --mtp-standalone --mtp-use-repeated-layer
        --mtp-detach-heads --mtp-hybrid-override-pattern
    """),
    'offloading to the CPU is not supported yet': _flags("""
        --cpu-offloading-num-layers --cpu-offloading-retain-pinned-cpu-buffers
          
        --delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks --activation-offload-fraction
        --fine-grained-offloading-max-inflight-offloads --optimizer-cpu-offload --optimizer-offload-fraction
        --use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads
        --no-pin-cpu-params
    """),
    ("GPU-only: megatron-core's fine-grained activation offloading copies saved activations to pinned host "
     "memory on CUDA streams; under our executor it would need its offload and reload hooks around each "
     "action's pass (not supported yet)"): _flags("""
        --fine-grained-activation-offloading --offload-modules --min-offloaded-tensor-size
    """),
    ("GPU-only: Transformer Engine's op fuser (te.ops) builds fused MLP ops that the CPU path's local layers do "
     "not have; on a GPU it would need our layer specs to build te.ops' Sequential modules (not supported yet)"
     ): _flags("""
        --use-transformer-engine-op-fuser
    """),
    ("torch FSDP2 shards every parameter over the data-parallel group; Chimera keeps a whole weight copy of each "
     "stage per pipeline and sums the copies' gradients (--use-distributed-optimizer shards the optimizer "
     "state instead)"): _flags("""
        --use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward
    """),
    'FSDP is not supported: Chimera keeps whole stage copies': _flags("""
        --init-model-with-meta-device --use-megatron-fsdp  --fsdp-manual-registration
        --data-parallel-sharding-strategy --outer-dp-sharding-strategy --fsdp-double-buffer
        --suggested-communication-unit-size --enable-full-sharding-in-hsdp
         --megatron-fsdp-main-params-dtype
        --megatron-fsdp-main-grads-dtype --megatron-fsdp-grad-comm-dtype
        --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer
        --fsdp-db-use-persist-buf-on-alloc-fail
    """),
    ("muP is not supported yet: megatron-core scales the model (embedding, output and attention multipliers); "
     "it would also need Megatron-LM's per-width learning rates in our optimizer's parameter groups"): _flags("""
        --use-mup --mup-width-mult --mup-base-hidden-size --mup-embedding-mult --mup-output-mult
        --mup-base-head-dim --mup-attn-scale-power
    """),
    'GPU-only: FP8 and FP4 need Transformer Engine on a GPU; not supported yet': _flags("""
        --fp8-format --fp8-recipe --fp8-quantizer-factory --fp8-margin --fp8-interval --fp8-amax-history-len
        --fp8-amax-compute-algo --no-fp8-wgrad --disable-fp8-wgrad --fp8-output-proj --first-last-layers-bf16
        --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16 --use-kitchen-attention
        --kitchen-attention-backend --fp4-format --fp4-recipe --fp4-quantizer-factory
        --reuse-grad-buf-for-mxfp8-param-ag --keep-fp8-transpose-cache --fp4-param-gather --fp8-param-gather
        --te-precision-config-file
    """),
    'GPU-only: CUDA graphs are not supported yet': _flags("""
        --enable-cuda-graph --cuda-graph-warmup-steps --external-cuda-graph --cuda-graph-impl
        --inference-cuda-graph-scope --optimizer-cuda-graph --cuda-graph-scope --cuda-graph-modules
        --inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens
    """),
    'an inference option; this is pretraining': _flags("""
        --flash-decode --batch-invariant-mode --symmetric-ar-type --nccl-all-reduce-for-prefill
        --inference-fuse-tp-communication --inference-disable-triton-nvls-kernels
        --inference-grouped-gemm-backend --inference-moe-disable-fused-quant-kernels
        --inference-moe-token-dispatcher-type --bert-no-binary-head --inference-rng-tracker --bert-load
        --inference-batch-times-seqlen-threshold --max-tokens-to-oom --output-bert-embeddings
        --bert-embedder-type --use-legacy-static-engine --inference-max-requests --inference-max-seq-length
        --inference-dynamic-batching --inference-dynamic-batching-buffer-size-gb
        --inference-dynamic-batching-paused-buffer-size-gb --inference-dynamic-batching-mamba-memory-ratio
        --inference-dynamic-batching-block-size --inference-dynamic-batching-max-requests
        --inference-dynamic-batching-max-tokens --inference-dynamic-batching-num-cuda-graphs
        --inference-dynamic-batching-track-paused-request-events
        --inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs
        --inference-dynamic-batching-unified-memory-level --enable-chunked-prefill --num-speculative-tokens
        --inference-dynamic-batching-prefix-caching --no-inference-dynamic-batching-prefix-caching
        --inference-dynamic-batching-prefix-caching-eviction-policy
        --inference-dynamic-batching-prefix-caching-coordinator-policy
        --inference-dynamic-batching-prefix-caching-routing-alpha
        --inference-dynamic-batching-prefix-caching-mamba-gb
        --inference-dynamic-batching-cuda-graph-mixed-prefill-count
        --inference-dynamic-batching-cuda-graph-sizing-distribution
        --inference-dynamic-batching-sampling-backend --use-same-sampling-seed-across-dp-ranks
        --inference-dynamic-batching-async-sched-mode --inference-dynamic-batching-logprobs-mode
        --inference-logging-step-interval --inference-text-gen-server-logging
        --no-inference-text-gen-server-logging --inference-wandb-logging --no-inference-wandb-logging
        --inference-coordinator-port --inference-use-synchronous-zmq-collectives
        --no-inference-use-synchronous-zmq-collectives --inference-disable-ep-consensus
        --no-inference-disable-ep-consensus --inference-shards
    """),
    'only Adam and Muon with fp32 states are implemented': _flags("""
        --sgd-momentum --lion-beta1 --lion-beta2
        --use-precision-aware-optimizer --main-grads-dtype --main-params-dtype --exp-avg-dtype
        --exp-avg-sq-dtype
    """),
    'a profiler option this trainer does not implement': _flags("""
        --pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack
        --pytorch-profiler-collect-chakra --record-memory-history --memory-snapshot-path --record-shapes
    """),
    ('a training-loop option this trainer does not implement (NaN/Inf steps are handled by '
     '--max-consecutive-nan-iterations)'): _flags("""
        --gpu-sniff-test-interval --train-sync-interval
        --exit-signal-handler-for-dataloader --exit-signal-handler-for-training --iterations-to-skip
        --dump-param-to-param-group-map
    """),
    ("Megatron-LM 0.19 fails with it itself: its core_transformer_config_from_args gives TransformerConfig a "
     "scaled_init_method it does not take"): _flags("""
        --init-method-xavier-uniform
    """),
    'removed from Megatron-LM (its own validate_args refuses it)': _flags("""
        --batch-size --checkpoint-activations --warmup
    """),
    'fault-tolerance and resiliency services are not supported (ours: faults end every rank with a message)': _flags("""
        --log-straggler --straggler-ctrlr-port
        --straggler-minmax-count --disable-straggler-on-startup --run-workload-inspector-server
        --inprocess-restart --inprocess-max-iterations --inprocess-monitor-thread-interval
        --inprocess-monitor-process-interval --inprocess-progress-watchdog-interval
        --inprocess-heartbeat-interval --inprocess-soft-timeout --inprocess-hard-timeout
        --inprocess-heartbeat-timeout --inprocess-barrier-timeout --inprocess-completion-timeout
        --inprocess-last-call-wait --inprocess-termination-grace-time --inprocess-granularity
        --inprocess-active-world-size --inprocess-empty-cuda-cache --enable-ft-package --calc-ft-timeouts
        --ft-num-warmup-iters --fault-injector-ranks --fault-injector-num-ranks --fault-injector-fault-types
        --fault-injector-fault-probabilities --fault-injector-fault-delay
        --fault-injector-delay-start-iteration --fault-injector-mtti-seconds --fault-injector-offset-seconds
        --fault-injector-seed
    """),
    'reinforcement learning is not part of pretraining': _flags("""
        --perform-rl-step --rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size --rl-generation-lag
        --rl-submission-granularity --rl-consumption-granularity --grpo-iterations --grpo-clamp-eps-lower
        --grpo-clamp-eps-upper --grpo-kl-beta --grpo-entropy-term-weight --grpo-filter-groups-with-same-reward
        --langrl-env-config --rl-default-temperature --rl-default-top-p --rl-default-top-k
        --rl-offload-optimizer-during-inference --rl-kv-cache-management-mode --rl-persist-cuda-graphs
        --no-rl-persist-cuda-graphs --rl-partial-rollouts --no-rl-partial-rollouts
        --rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction
        --rl-importance-sampling-truncation-coef --rl-use-sequence-packing --no-rl-use-sequence-packing
        --rl-sequence-packing-max-sequences-per-bin --rl-sequence-packing-algo --rl-training-cuda-graphs
        --no-rl-training-cuda-graphs --rl-inference-tensor-model-parallel-size
        --rl-inference-pipeline-model-parallel-size --rl-inference-expert-model-parallel-size
        --rl-inference-expert-tensor-model-parallel-size --rl-inference-model-unified-memory-level
        --rl-offload-inference-model-weights-when-idle --no-rl-offload-inference-model-weights-when-idle
        --refit-method --rl-verify-model-weights-swap --no-rl-verify-model-weights-swap --rl-skip-bos-token
        --no-rl-skip-bos-token --rl-profile --rl-profile-dir --rl-inference-parsers
    """),
    'the WSD learning-rate schedule is not supported yet': _flags("""
        --lr-wsd-decay-style --lr-wsd-decay-iters --lr-wsd-decay-samples
    """),
    'a checkpoint option this trainer does not implement (it saves and loads whole torch_dist checkpoints)': _flags("""
        --save-params-interval --save-activations-interval --save-tokens-per-expert-interval
        --save-wgrads-interval --save-dgrads-interval --load-main-params-from-ckpt
        --non-persistent-save-interval --non-persistent-ckpt-type --non-persistent-global-ckpt-dir
        --non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo --pretrained-checkpoint --ckpt-step
        --use-mp-args-from-checkpoint-args --ckpt-convert-format --ckpt-convert-save
        --ckpt-convert-update-legacy-dist-opt-format
        --no-ckpt-load-validate-sharding-integrity
        --disable-ckpt-load-validate-sharding-integrity --no-strict-fsdp-dtensor-load
        --disable-strict-fsdp-dtensor-load --dist-ckpt-save-pre-mcore-014
        --replication --replication-jump --replication-factor --no-stream-ckpt-dequant
        --disable-stream-ckpt-dequant --no-save-rng --override-ckpt-iteration
        --dist-ckpt-format
    """),
    'validation runs --eval-iters global batches every --eval-interval; other modes are not supported yet': _flags("""
        --start-eval-at-iter --skip-train
        --full-validation --multiple-validation-sets --validation-set-names
    """),
    'data comes from --data-path (a prefix or a blend) or --mock-data, with causal attention': _flags("""
        --phase-transition-iterations --train-data-path --valid-data-path --test-data-path --data-args-path
        --per-split-data-args-path --per-dataset-sequences-path --dataloader-fast-cache-load
        --dataloader-defer-npy-index-mmap --sample-rate --mask-prob --short-seq-prob --reset-attention-mask
        --dataloader-inter-document-masking --num-dataset-builder-threads --object-storage-cache-path
        --mid-level-dataset-surplus --allow-ambiguous-pad-tokens
    """),
    ('tokenizers are built from --tokenizer-type, --tokenizer-model, --vocab-file, --merge-file and '
     '--vocab-size only'): _flags("""
        --vocab-extra-ids --tokenizer-sentencepiece-legacy --tokenizer-metadata --tokenizer-special-tokens
        --no-tokenizer-sentencepiece-ignore-extra-whitespaces
        --disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast
        --tokenizer-hf-no-include-special-tokens --null-tokenizer-eod-id
        --null-tokenizer-pad-id --chat-template
    """),
    'ADLR autoresume is an NVIDIA cluster service': _flags("""
        --adlr-autoresume --adlr-autoresume-interval
    """),
    'biencoder/retrieval models are not GPT pretraining': _flags("""
        --ict-head-size --biencoder-projection-dim --biencoder-shared-query-context-model --ict-load
        --titles-data-path --query-in-block-prob --use-one-sent-docs --evidence-data-path
        --retriever-report-topk-accuracies --retriever-score-scaling --block-data-path --embedding-path
        --indexer-batch-size --indexer-log-interval
    """),
    'vision models are not GPT pretraining': _flags("""
        --num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction --data-per-class-fraction
        --no-data-sharding --head-lr-mult --vision-pretraining --vision-pretraining-type
        --vision-backbone-type --swin-backbone-type --mask-type --mask-factor --iter-per-epoch
        --dino-local-img-size --dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size
        --dino-freeze-last-layer --dino-norm-last-layer --dino-warmup-teacher-temp --dino-teacher-temp
        --dino-warmup-teacher-temp-epochs
    """),
    'logits distillation is not supported': _flags("""
        --logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k --logits-save-dir
        --logits-save-dtype --logits-load-dir --logits-load-decode-threads --logits-load-prefetch-factor
        --logits-load-msc-prefetch-depth --logits-load-kd-loss-alpha --logits-load-ignore-errors
    """),
    'the Multi-Storage Client is not supported': _flags("""
        --enable-msc
    """),
    'supervised fine-tuning is not supported': _flags("""
        --sft --sft-tokenizer-prompt-format
    """),
    "Megatron-LM's experimental YAML configuration replaces the command line: give the flags instead": _flags("""
        --yaml-cfg
    """),
}

# Honoured flags whose other values are refused, with what runs (the rule names the first value
# Megatron-LM would accept and we do not).
VALUES = {
    "--optimizer": ("adam", "muon"),
    "--muon-scalar-optimizer": ("adam",),  # megatron-core's other choice, Lion, is not implemented
    # Megatron-LM 0.19's GPT builder (gpt_config_from_args) gives GPTModel its default, 8.0, whatever this says
    "--rope-scaling-factor": (8.0,),
    "--moe-token-dispatcher-type": ("allgather", "alltoall", "flex"),
    "--moe-router-load-balancing-type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
    "--moe-router-score-function": ("softmax", "sigmoid"),
    "--dataloader-type": (None, "single", "cyclic"),
    "--transformer-impl": ("transformer_engine", "local"),
    "--ckpt-format": ("torch_dist", "torch"),
    # return_*: megatron-core's load returns the mismatched keys beside the state, which Megatron-LM's loader
    # does not take (it fails on the tuple)
    "--dist-ckpt-strictness": ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                               "ignore_all"),
    "--position-embedding-type": ("learned_absolute", "rope", "none"),
    "--lr-decay-style": ("constant", "linear", "cosine", "inverse-square-root"),
    "--tokenizer-type": (None, "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                         "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer"),
}


def flag_class(option: str) -> tuple[str, str]:
    """(class, reason) of one option string; KeyError if it has none."""
    if option in HONOURED:
        return "honoured", ""
    for table, name in ((NO_EFFECT, "no effect"), (REFUSED, "refused")):
        for reason, options in table.items():
            if option in options:
                return name, reason
    raise KeyError(option)
