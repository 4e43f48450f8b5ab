"""The model's architecture flags, after Megatron-LM's validate_args has derived the position embedding,
the FFN width and the kv channels: query groups, RoPE, multi-latent attention, the recipes' attention and
MLP flags, context parallelism's attention, megatron-core's config fields, and mixture of experts; with
what megatron-core's local layers and Transformer Engine's (layer_probes.py) each run."""
from __future__ import annotations

import torch
from megatron.core.transformer.moe import fused_a2a

from chimera_schedules.ir.errors import require

from .layer_probes import TransformerEngine


def check_architecture(args, transformer_engine: TransformerEngine) -> None:
    """Query groups only with --group-query-attention (megatron-core's None otherwise), as megatron-core's
    config reads them; then each part's rules."""
    if not args.group_query_attention:
        args.num_query_groups = None
    else:
        groups, tp = args.num_query_groups, args.tensor_model_parallel_size
        require(groups is not None and groups > 0 and args.num_attention_heads % groups == 0, "--num-query-groups",
                groups, f"must divide --num-attention-heads ({args.num_attention_heads})")
        require(groups % tp == 0, "--num-query-groups", groups,
                f"must be a multiple of --tensor-model-parallel-size ({tp})")
    require(args.rope_type in (None, "rope") or args.multi_latent_attention, "--rope-type", args.rope_type,
            "applies to --multi-latent-attention; standard attention runs rope (Megatron-LM's rule)")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    te = transformer_engine.uses_transformer_engine(args.transformer_impl, device_type)
    require(not (args.multi_latent_attention and args.tensor_model_parallel_size > 1 and not args.sequence_parallel)
            or not te, "--sequence-parallel", False,
            "is required with --multi-latent-attention and tensor parallelism in Transformer Engine's layers: "
            "without it megatron-core 0.19's duplicated key-value down projection keeps only each rank's own heads' "
            "share of the key's position gradient (megatron-core's local layers are corrected here)")
    require(not (args.multi_latent_attention and args.qk_layernorm and args.q_lora_rank is None) or te,
            "--qk-layernorm", True,
            "with --multi-latent-attention and no --q-lora-rank normalises inside Transformer Engine's fused "
            "norm and query projection, which megatron-core 0.19's local layers lack: give --q-lora-rank, or "
            "run Transformer Engine on a GPU")
    _validate_recipe_layers(args, te)
    context_parallel_attention(args, device_type, te)
    _validate_config_fields(args)
    if args.num_experts is not None:
        _validate_experts(args)


def context_parallel_attention(args, device_type: str, te: bool) -> None:
    """Which attention runs a sequence split over CP ranks (model/context_parallel.py): Transformer Engine's
    (``te``: its layers run here) on a GPU, as megatron-core's; on the CPU megatron-core's local attention over
    all-gathered keys and values, for standard causal attention over whole sequences."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    require(te or device_type == "cpu", "--context-parallel-size", cp,
            "needs Transformer Engine's attention on a GPU (megatron-core's local attention refuses CP > 1): "
            "install transformer-engine and run --transformer-impl transformer_engine")
    if te:
        return
    require(not args.multi_latent_attention, "--context-parallel-size", cp,
            "on the CPU runs standard attention only, not --multi-latent-attention")
    require(args.window_size is None, "--context-parallel-size", cp,
            "on the CPU runs full causal attention only, not --window-size")


def _validate_recipe_layers(args, te: bool) -> None:
    """Llama 3.1's RoPE and gpt-oss's attention and MLP flags: Megatron-LM's rules, and what megatron-core's
    layers run (its local attention has no unlimited window side; it picks windowed layers by layer number)."""
    require(not (args.quick_geglu and args.swiglu), "--quick-geglu", True,
            "cannot be combined with --swiglu (Megatron-LM's rule)")
    factor = args.rotary_seq_len_interpolation_factor
    require(factor is None or factor > 0, "--rotary-seq-len-interpolation-factor", factor, "must be positive")
    window, freq = args.window_size, args.window_attn_skip_freq
    if window is None:
        return
    shown = ",".join(map(str, window))
    require(len(window) == 2, "--window-size", shown, "takes the window's left and right sizes, e.g. 128,0")
    require(min(window) >= 0 or te, "--window-size", shown,
            "with a negative (unlimited) side runs in Transformer Engine's attention only: megatron-core 0.19's "
            "local attention then masks every position")
    require(not isinstance(freq, list) or len(freq) == args.num_layers, "--window-attn-skip-freq", freq,
            f"must give one entry per layer ({args.num_layers})")
    require(isinstance(freq, list) or freq is None or freq > 0, "--window-attn-skip-freq", freq, "must be positive")
    require(not (args.mtp_num_layers and freq is not None), "--mtp-num-layers", args.mtp_num_layers,
            "with --window-size and --window-attn-skip-freq is not supported yet: megatron-core numbers MTP "
            "layers 1, 2, ... apart from the model's, and a pipeline stage's slice of the window pattern numbers "
            "them as its own layers")


def _validate_config_fields(args) -> None:
    """Flags whose meaning is a field of megatron-core's config: the rules Megatron-LM's config builder and
    megatron-core check at construction (with a traceback), in one line before anything starts."""
    require(not (args.squared_relu and args.swiglu), "--squared-relu", True,
            "cannot be combined with --swiglu (Megatron-LM's rule)")
    require(not (args.squared_relu and args.bias_gelu_fusion), "--squared-relu", True,
            "needs --no-bias-gelu-fusion or --disable-bias-linear (megatron-core fuses the bias with gelu, swiglu "
            "and quick_geglu only)")
    for flag, given in (("--qk-l2-norm", args.qk_l2_norm), ("--attention-output-gate", args.attention_output_gate)):
        require(not (given and args.multi_latent_attention), flag, True,
                "is not supported with --multi-latent-attention (megatron-core's rule)")
    std = args.embedding_init_method_std
    require(std is None or std >= 0, "--embedding-init-method-std", std, "must not be negative")
    freq, layers = args.no_rope_freq, args.num_layers
    if freq is None:
        return
    require(len(freq) == layers if isinstance(freq, list) else freq > 0 and layers % freq == 0, "--no-rope-freq",
            freq, f"must give one entry per layer or a number that divides them ({layers}; megatron-core's rule)")
    require(not args.mtp_num_layers, "--mtp-num-layers", args.mtp_num_layers,
            "with --no-rope-freq is not supported yet: megatron-core numbers MTP layers 1, 2, ... apart from the "
            "model's, and a pipeline stage's slice of the pattern numbers them as its own layers")


# megatron-core's flex dispatcher backends: the kernels each runs, and megatron-core's own test that they are here
FLEX_KERNELS = {"deepep": ("DeepEP's", "HAVE_DEEP_EP", "the deep_ep package"),
                "hybridep": ("HybridEP's", "HAVE_HYBRIDEP", "the deep_ep package with HybridEPBuffer"),
                "ncclep": ("NCCL-EP's", "HAVE_TE_EP", "Transformer Engine with transformer_engine.pytorch.ep")}


def _check_flex(args) -> None:
    """--moe-token-dispatcher-type flex runs megatron-core's flex dispatcher, whose backends are GPU kernels
    (DeepEP, HybridEP, NCCL-EP): on a GPU with the backend's package installed, inside each MoE layer under any
    schedule; elsewhere refused, naming the kernel."""
    if args.moe_token_dispatcher_type != "flex":
        return
    backend = "deepep" if args.moe_enable_deepep else args.moe_flex_dispatcher_backend
    kernels, have, package = FLEX_KERNELS[backend]
    require(torch.cuda.is_available(), "--moe-token-dispatcher-type", "flex", f"GPU-only: megatron-core's flex "
            f"dispatcher runs {kernels} kernels (--moe-flex-dispatcher-backend {backend}) on NVIDIA GPUs; on this "
            "machine give --moe-token-dispatcher-type alltoall")
    require(getattr(fused_a2a, have), "--moe-flex-dispatcher-backend", backend,
            f"needs {package} (megatron-core finds no {kernels} kernels here)")


def _validate_experts(args) -> None:
    """Mixture of experts: the layer pattern covers the model, and what is not supported yet says so."""
    freq = args.moe_layer_freq
    require(not isinstance(freq, list) or len(freq) == args.num_layers, "--moe-layer-freq", freq,
            f"must give one entry per layer ({args.num_layers})")
    require(not args.fp16, "--fp16", True, "with --num-experts is not supported yet (with the auxiliary losses "
            "loss-scaled as megatron-core scales them, one process and every pipelined layout still differ "
            "beyond fp16's bound): give --bf16")
    require(not args.add_bias_linear, "--disable-bias-linear", False,
            "is required with --num-experts: megatron-core 0.19's expert MLPs with biases fail in autograd (an "
            "in-place update of a view); Megatron-LM's MoE recipes set it")
    require(args.tensor_model_parallel_size == 1 or args.sequence_parallel, "--sequence-parallel", False,
            "is required with --num-experts and tensor parallelism (megatron-core's rule for MoE layers)")
    _check_flex(args)
    require(not (args.moe_shared_expert_overlap and args.moe_shared_expert_intermediate_size)
            or args.moe_token_dispatcher_type == "alltoall", "--moe-shared-expert-overlap", True,
            "needs --moe-token-dispatcher-type alltoall (megatron-core's rule)")
    require(args.moe_router_load_balancing_type != "sinkhorn" or not args.moe_aux_loss_coeff, "--moe-aux-loss-coeff",
            args.moe_aux_loss_coeff, "must be 0 with --moe-router-load-balancing-type sinkhorn (megatron-core's rule)")
