"""Model chunks: one megatron-core GPTModel per (pipeline, stage) copy this worker holds.

A chunk of model stage s holds what the run plan's layout gives it (``chimera_schedules.ir.layout``):
its layers, contiguous in the model, and the embedding, MTP layers and output layer where the layout
puts them. It is built as a GPTModel of just those layers whose config says "no pipeline" (so
megatron-core neither offsets its layers nor ties its embedding with collectives); pre_process and
post_process mark the stages holding E and L.

Initialisation is a function of (seed, global parameter name) only: every tensor is drawn from a
generator seeded with both, at its full (unsharded) shape, then sliced to this rank's tensor-parallel
shard. So every copy of a stage, in every pipeline and layout, and the one-process reference start
from the same weights without any broadcast; the tied output layer is drawn under the input
embedding's name. Distributions are Megatron's: normal(0, std) for weights, std / sqrt(2 L) for the
output projections of attention and MLP, ones and zeros for norms, zeros for biases.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import re
import zlib

import torch

# TransformerConfig fields a GPT recipe sets whose Megatron-LM flag stores them under the field's name
# (--norm-epsilon in layernorm_epsilon, --apply-layernorm-1p in layernorm_zero_centered_gamma); the other
# honoured model flags are mapped in transformer_config.
ARCHITECTURE = ("ffn_hidden_size", "kv_channels", "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma",
                "qk_layernorm", "add_qkv_bias", "hidden_dropout", "attention_dropout", "init_method_std",
                "apply_residual_connection_post_layernorm", "rotary_interleaved", "attention_backend",
                "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "calculate_per_token_loss",
                # gpt-oss's attention sink and clamped, offset GLU; sliding windows (window_attn_skip_freq is
                # the stage's: _window_layers)
                "softmax_type", "window_size", "glu_linear_offset", "activation_func_clamp_value",
                "disable_bf16_reduced_precision_matmul")
# Mixture-of-experts fields, under the same name in Megatron-LM's arguments and TransformerConfig
MOE = ("moe_ffn_hidden_size", "moe_router_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
       "moe_z_loss_coeff", "moe_token_dispatcher_type", "moe_router_score_function", "moe_router_pre_softmax",
       "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk", "moe_router_dtype",
       "moe_shared_expert_intermediate_size", "moe_expert_capacity_factor", "moe_token_drop_policy",
       "moe_pad_expert_input_to_capacity", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
       "moe_router_force_load_balancing")
# --recompute-modules that only Transformer Engine's layers recompute: the activation of its grouped experts
# (TEGroupedMLP); megatron-core's local experts (SequentialMLP) have no such checkpoint
TE_RECOMPUTE = ("moe_act",)
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
# Transformer Engine's grouped experts
GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
TIED_NAME = "embedding.word_embeddings.weight"


def uses_transformer_engine(args, device_type: str) -> bool:
    """Transformer Engine's layers on a GPU where it is installed, unless --transformer-impl local."""
    return device_type == "cuda" and args.transformer_impl == "transformer_engine" and _transformer_engine_installed()


def _transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_version() -> str:
    """The installed Transformer Engine's version as megatron-core reads it ("0.0.0" without one)."""
    from megatron.core.utils import get_te_version

    return str(get_te_version())


def te_at_least(version: str) -> bool:
    """Whether the installed Transformer Engine is ``version`` or later, as megatron-core's own checks ask."""
    from packaging.version import Version

    return Version(transformer_engine_version()) >= Version(version)


def delayed_wgrad_te(args) -> str:
    """The Transformer Engine release whose layers can run a split backward (B with their weight gradients
    delayed, W as their ``backward_dw()``) under these flags, by Megatron-LM's own rule for
    delay_wgrad_compute: 2.3 brought it; 2.7 without gradient-accumulation fusion (before it, TE hands
    autograd uninitialised weight-gradient buffers in B, which a hook would add); 2.8 with
    --overlap-grad-reduce."""
    if args.overlap_grad_reduce:
        return "2.8.0"
    return "2.3.0" if args.gradient_accumulation_fusion else "2.7.0"


def delays_weight_gradients(args) -> bool:
    return te_at_least(delayed_wgrad_te(args))


# the two kernels megatron-core's FusedScaleMaskSoftmax imports: causal, and with an explicit mask
SOFTMAX_KERNELS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")


def _kernel_installed(module: str) -> bool:
    """Whether a compiled extension megatron-core imports for a fused kernel (apex's) is installed."""
    return importlib.util.find_spec(module) is not None


def megatron_fusions(args) -> dict[str, bool]:
    """The fusion fields of TransformerConfig as Megatron-LM's core_transformer_config_from_args sets them
    from the flags (after its validate_args, which turns bias-GELU fusion off without biases and RoPE
    fusion off without RoPE): Megatron-LM's values on a GPU."""
    return {"gradient_accumulation_fusion": args.gradient_accumulation_fusion,  # --no-gradient-accumulation-fusion
            # --no-bias-swiglu-fusion, --no-bias-gelu-fusion
            "bias_activation_fusion": args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
            "bias_dropout_fusion": args.bias_dropout_fusion,  # --no-bias-dropout-fusion
            "apply_rope_fusion": args.apply_rope_fusion,  # --no-rope-fusion
            "masked_softmax_fusion": args.masked_softmax_fusion,  # --no-masked-softmax-fusion
            "persist_layer_norm": not args.no_persist_layer_norm}  # --no-persist-layer-norm


def _masked_softmax_fusion_missing(args, te: bool) -> str | None:
    if te:
        return None
    if args.window_size is not None:  # megatron-core's fused softmax would attend past the window
        return "megatron-core's fused masked softmax ignores --window-size"
    if all(map(_kernel_installed, SOFTMAX_KERNELS)):
        return None
    return "megatron-core's local attention needs apex's fused softmax"


def fusions_off(args, device_type: str, split_backward: bool = False) -> dict[str, str]:
    """Each fusion the flags ask for that stays off here, and why: on the CPU all of them (their kernels
    are CUDA's); on a GPU those megatron-core cannot run here (its kernel is not installed, or its own
    rules exclude the case: Megatron-LM fails on these instead), and the gradient-accumulation fusion of
    megatron-core's local linears under a split backward, which multiply with torch's own ops there
    (``_splittable_linears``) so that I and W each compute only their part."""
    asked = [field for field, on in megatron_fusions(args).items() if on]
    if device_type != "cuda":
        return dict.fromkeys(asked, "on the CPU: their kernels are CUDA's")
    te = uses_transformer_engine(args, device_type)
    missing = {"gradient_accumulation_fusion": _gradient_accumulation_fusion_missing(te, split_backward),
               "apply_rope_fusion": _rope_fusion_missing(args),
               "masked_softmax_fusion": _masked_softmax_fusion_missing(args, te),
               "persist_layer_norm": None if te or _kernel_installed("apex")
               else "megatron-core's local norms without apex are torch's, which have no persistent kernel"}
    return {field: missing[field] for field in asked if missing.get(field)}


def _gradient_accumulation_fusion_missing(te: bool, split_backward: bool) -> str | None:
    if split_backward and not te:
        return "a split backward's local linears multiply with torch's own ops"
    if not _kernel_installed("fused_weight_gradient_mlp_cuda"):  # the output layer is always megatron-core's
        return "megatron-core's linears need apex's fused_weight_gradient_mlp_cuda"
    return None


def _rope_fusion_missing(args) -> str | None:
    """megatron-core's own rules for apply_rope_fusion (TransformerConfig, MLATransformerConfig)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        return "needs Transformer Engine's fused RoPE"
    if args.multi_latent_attention and args.rope_type == "rope":
        return "megatron-core fuses multi-latent attention's RoPE for YaRN only"
    if args.rotary_interleaved and not args.multi_latent_attention and not te_at_least("2.3.0"):
        return "interleaved RoPE needs Transformer Engine 2.3 or later"
    return None


def fusion_fields(args, device_type: str, split_backward: bool = False) -> dict[str, bool]:
    """The fusion fields of a chunk's TransformerConfig: Megatron-LM's, but those ``fusions_off`` keeps off."""
    off = fusions_off(args, device_type, split_backward)
    return {field: on and field not in off for field, on in megatron_fusions(args).items()}


def _layer_spec(args, config, device: torch.device):
    """Transformer Engine's spec where ``uses_transformer_engine``, megatron-core's local spec otherwise;
    with --num-experts, each layer dense or mixture-of-experts as ``config.moe_layer_freq`` says."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if config.num_layers == 0:  # a stage of only E, m or L: the block's final norm and no layer
        # (delay_wgrad_compute, set after construction, would fail the probe's __post_init__)
        probe = dataclasses.replace(config, num_layers=1, delay_wgrad_compute=False,
                                    **({"moe_layer_freq": 1} if config.num_moe_experts else {}))
        spec = _layer_spec(args, probe, device)  # a block (local norms, MoE), or Transformer Engine's layer
        return dataclasses.replace(spec, layer_specs=[]) if hasattr(spec, "layer_specs") else _block([])
    te = uses_transformer_engine(args, device.type)
    if config.num_moe_experts is not None:
        specs = get_gpt_decoder_layer_specs(config, te, normalization=args.normalization)
        return _block(specs) if te else _with_local_norms(specs, config)
    mla = args.multi_latent_attention
    if te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm, multi_latent_attention=mla)
    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization,
                                    multi_latent_attention=mla)
    return _with_local_norms([spec] * config.num_layers, config)


def _block(specs: list, norm=None):
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm or TENorm)


def _with_local_norms(specs: list, config):
    """Without apex the local spec uses torch's norms, which megatron-core refuses with zero-centred
    gamma (--apply-layernorm-1p) and with sequence parallelism. LocalNorm does both; the final norm
    goes in through the block spec."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if specs[0].submodules.input_layernorm is not WrappedTorchNorm:
        return _block(specs, LNImpl)  # apex's FusedLayerNorm has both
    for spec in {id(spec): spec for spec in specs}.values():
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = LocalNorm
        attention = layer.self_attention.submodules
        if hasattr(attention, "kv_layernorm"):  # multi-latent attention
            attention.core_attention = latent_core_attention()
            if attention.kv_layernorm is WrappedTorchNorm:  # norms of the latents, whole vectors; no query
                attention.kv_layernorm = LocalNorm  # latent without --q-lora-rank, so no norm of it
                attention.q_layernorm = LocalNorm if config.q_lora_rank is not None else IdentityOp
        elif attention.q_layernorm is WrappedTorchNorm:
            attention.q_layernorm = attention.k_layernorm = HeadNorm
    return _block(specs, LocalNorm)


def latent_core_attention():
    """megatron-core's local attention for multi-latent attention, whose keys and values have head
    sizes of their own (``k_channels``, ``v_channels``): 0.19's local attention takes neither (Transformer
    Engine's does), though its arithmetic follows the tensors' shapes but for the output's width."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentCoreAttention(DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:  # megatron-core's Attention first builds one without them
                self.hidden_size_per_partition = (v_channels * config.num_attention_heads
                                                  // config.tensor_model_parallel_size)

    return LatentCoreAttention


def moe_layer_pattern(args) -> list[int] | None:
    """Per layer of the whole model, 1 for mixture-of-experts and 0 for dense (--moe-layer-freq: one
    in every N, or the list itself, as megatron-core reads it); None without --num-experts."""
    if args.num_experts is None:
        return None
    freq = args.moe_layer_freq
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(args.num_layers)]


class LocalNorm(torch.nn.Module):
    """LayerNorm or RMSNorm over the hidden size, with megatron-core's parameter names. Zero-centred
    gamma stores gamma - 1. Under sequence parallelism the parameters are marked ``sequence_parallel``,
    as megatron-core's own norms mark theirs (``mark_tensor_parallel_sums`` reads the mark)."""

    spans_sequence_split = True

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.eps, self.zero_centered = eps, config.layernorm_zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = None if config.normalization == "RMSNorm" else torch.nn.Parameter(torch.zeros(hidden_size))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel and self.spans_sequence_split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.bias is None:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, self.bias, self.eps)


class HeadNorm(LocalNorm):
    """Query and key norms: per head, inside attention, where every rank has the whole sequence but
    only its tensor-parallel share of the heads (their gradients are summed over the group by name, as
    megatron-core's finalize_model_grads does for q_layernorm and k_layernorm)."""

    spans_sequence_split = False


def _latent_attention(args) -> dict:
    """--multi-latent-attention: megatron-core's MLA config fields, read from the flags of the same names
    as Megatron-LM reads them (rope_type left to MLA's default, yarn, unless given)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    own = ({f.name for f in dataclasses.fields(MLATransformerConfig)}
           - {f.name for f in dataclasses.fields(TransformerConfig)})
    fields = {name: getattr(args, name) for name in sorted(own) if hasattr(args, name)}
    if args.rope_type is None:
        fields.pop("rope_type", None)
    return fields


def _experts(args, num_layers: int, first_layer: int, transformer_engine: bool) -> dict:
    """--num-experts: the MoE fields, with the stage's slice of the layer pattern (every layer MoE stays
    megatron-core's 1, so a chunk's checkpoint keys stack its layers exactly when the whole model's do)."""
    pattern = moe_layer_pattern(args)
    if pattern is None:
        return {}
    freq = 1 if args.moe_layer_freq == 1 else pattern[first_layer:first_layer + num_layers]
    return {**{name: getattr(args, name) for name in MOE}, "num_moe_experts": args.num_experts,
            "moe_layer_freq": freq, "expert_model_parallel_size": args.expert_model_parallel_size,
            "expert_tensor_parallel_size": args.expert_tensor_parallel_size,
            "moe_grouped_gemm": args.moe_grouped_gemm and transformer_engine,
            "moe_layer_recompute": args.moe_layer_recompute}


def _activation(args) -> dict:
    """The MLP's activation as Megatron-LM's core_transformer_config_from_args sets it: --swiglu is a
    SiLU-gated unit, --quick-geglu (gpt-oss) a quick-GELU-gated one, GELU otherwise."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if args.swiglu:
        return {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu}
    if args.quick_geglu:
        return {"gated_linear_unit": True, "activation_func": quick_gelu}
    return {"gated_linear_unit": False, "activation_func": torch.nn.functional.gelu}


def _window_layers(args, first_layer: int, num_layers: int):
    """--window-attn-skip-freq for a chunk's layers. megatron-core picks sliding-window attention by the
    layer's number, which in Megatron-LM counts through the whole model (after the pipeline offset) but
    in a chunk from its first layer: so with --window-size the chunk gets its slice of the model's
    pattern, as a list (1: sliding window), as moe_layer_freq gets its slice in _experts."""
    from megatron.core.transformer.utils import is_layer_window_attention

    if args.window_size is None or args.window_attn_skip_freq is None:
        return args.window_attn_skip_freq  # every layer windowed, or no window at all
    return [int(is_layer_window_attention(args.window_size, args.window_attn_skip_freq, first_layer + i + 1))
            for i in range(num_layers)]


def te_only_recompute(args, transformer_engine: bool) -> list[str]:
    """The --recompute-modules listed that only Transformer Engine's layers recompute, where megatron-core's
    local layers run instead (none under Transformer Engine)."""
    return [] if transformer_engine else [m for m in args.recompute_modules or () if m in TE_RECOMPUTE]


def recompute_modules(args, transformer_engine: bool) -> list[str] | None:
    """--recompute-modules as Megatron-LM passes it (None: megatron-core's default, core_attn), less the
    modules ``te_only_recompute`` names: megatron-core refuses moe_act without grouped GEMMs, which are
    Transformer Engine's (``_experts``)."""
    if args.recompute_modules is None:
        return None
    skipped = te_only_recompute(args, transformer_engine)
    return [m for m in args.recompute_modules if m not in skipped]


def shared_expert_overlap(args, device_type: str) -> bool:
    """--moe-shared-expert-overlap on a GPU: megatron-core runs the shared experts on a CUDA side stream
    beside the token dispatch. The CPU has one stream: the shared experts run before the router, as without
    the flag, computing the same (megatron-core notes that only the input's gradient sums its two parts in
    another order)."""
    return args.moe_shared_expert_overlap and device_type == "cuda"


def transformer_config(args, num_layers: int, first_layer: int = 0, device_type: str = "cpu",
                       split_backward: bool = False):
    """The config of a chunk of ``num_layers`` layers starting at layer ``first_layer`` of the model
    (megatron-core's MLA config with --multi-latent-attention), for a chunk on ``device_type`` in a run
    whose plan splits its backward or not."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    transformer_engine = uses_transformer_engine(args, device_type)
    architecture = {name: getattr(args, name) for name in ARCHITECTURE}
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    if args.multi_latent_attention:
        architecture.update(_latent_attention(args))
    architecture.update(_experts(args, num_layers, first_layer, transformer_engine))
    architecture.update(fusion_fields(args, device_type, split_backward))
    from megatron.core.utils import init_method_normal

    config = config_class(
        num_layers=num_layers,
        # Megatron's scaled init counts the whole model's layers (and a stage may hold none); init_chunk
        # redraws every tensor anyway
        output_layer_init_method=init_method_normal(args.init_method_std / math.sqrt(2.0 * args.num_layers)),
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        **architecture,
        num_query_groups=args.num_query_groups,
        **_activation(args),
        window_attn_skip_freq=_window_layers(args, first_layer, num_layers),
        add_bias_linear=args.add_bias_linear,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        fp16=args.fp16,
        bf16=args.bf16,
        pipeline_dtype=args.params_dtype,
        params_dtype=args.params_dtype,
        use_cpu_initialization=True,
        # megatron-core's own init also sets the tensor-parallel attributes (partition_dim, ...) that
        # init_chunk and the gradient norm rely on; init_chunk then redraws every tensor.
        perform_initialization=True,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method if args.recompute_granularity == "full" else None,
        recompute_num_layers=args.recompute_num_layers if args.recompute_granularity == "full" else None,
        recompute_modules=recompute_modules(args, transformer_engine),
        moe_shared_expert_overlap=shared_expert_overlap(args, device_type),
        # megatron-core's interleaved schedule runs micro-batches in groups of PP per virtual stage
        microbatch_group_size_per_vp_stage=args.pipeline_model_parallel_size,
        cuda_graph_scope=[],  # the whole layer; megatron-core's default spelling of it ("full") warns
        # the layers' own backend, which multi-latent attention reads to pick its projections
        transformer_impl="transformer_engine" if transformer_engine else "local",
    )
    # A split backward with Transformer Engine's layers: B queues their weight-gradient GEMMs and W runs them
    # (_delayed_weight_gradients). Set after construction: megatron-core's __post_init__ allows the field
    # only with its own combined-1F1B overlap (--overlap-moe-expert-parallel-comm); our executor runs W itself.
    # With that flag our schedule plan splits the backward itself (model/schedule_plan.py), so it stays off.
    config.delay_wgrad_compute = split_backward and transformer_engine and not args.overlap_moe_expert_parallel_comm
    return config


def build_chunk(args, plan, stage: int, device: torch.device):
    """Model stage ``stage`` of the run plan's layout, as megatron-core's GPTModel: its layers, the
    embedding where the layout puts E, the output layer and loss where it puts L, and megatron-core's
    MTP block where it puts m."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from . import recompute

    recompute.apply()  # --recompute-modules layernorm without Transformer Engine
    held, te = plan.layout.stages[stage], uses_transformer_engine(args, device.type)
    first = plan.layout.first_layer(stage)
    config = transformer_config(args, held.layers, first, device.type, plan.split_backward)
    _experimental(args)
    with _one_stage_view():
        model = GPTModel(
            config,
            _layer_spec(args, config, device),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=held.embedding,
            post_process=held.loss,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            **rope_scaling(args),
            mtp_block_spec=_mtp_block_spec(args, config, device, plan.split_backward) if held.mtp else None,
        )
    if args.mtp_num_layers and not plan.layout.holds_last_layer(stage):
        model.decoder.final_layernorm = None  # with MTP, megatron-core puts it after the last layer only
    if held.mtp and held.loss and not args.untie_embeddings_and_output_weights:
        # tied, megatron-core's stage of MTP and loss computes its logits with its embedding's weight (the
        # copy MTP needs) and keys no output layer in its checkpoint: the unused matrix is not kept
        model.output_layer.weight = None
    model.stage = stage
    mark_per_head(model)
    mark_tensor_parallel_sums(model, model.config)
    init_chunk(model, args, first)
    if plan.split_backward:
        (_delayed_weight_gradients if te else _splittable_linears)(model)
    return model.to(device, args.params_dtype)  # as Megatron's Float16Module casts the whole chunk


def rope_scaling(args) -> dict:
    """GPTModel's RoPE arguments beyond base and percent, from Megatron-LM's flags as its GPT builder
    passes them (gpt_config_from_args): Llama 3.1's frequency scaling (--use-rope-scaling) by
    --rope-scaling-factor (8.0, the only value Megatron-LM 0.19's builder gives GPTModel; flag_classes
    refuses others), and position interpolation (--rotary-seq-len-interpolation-factor)."""
    return {"rope_scaling": args.use_rope_scaling, "rope_scaling_factor": args.rope_scaling_factor,
            "seq_len_interpolation_factor": args.rotary_seq_len_interpolation_factor}


def _experimental(args) -> None:
    """--enable-experimental: megatron-core's process-wide switch for the code it marks experimental,
    set as Megatron-LM's set_global_variables sets it, before the model that reads it is built."""
    from megatron.core.config import set_experimental_flag

    set_experimental_flag(args.enable_experimental)


@contextlib.contextmanager
def _one_stage_view():
    """megatron-core's GPTModel asks parallel_state's pipeline rank whether it is the last stage (to
    place MTP), which is wrong for a copy whose stage is not its rank (Chimera's second pipeline,
    DualPipe's V). The chunk is built as the one-stage model its config describes; what it holds is
    the layout's, given explicitly."""
    from megatron.core import parallel_state

    parallel_state.set_pipeline_model_parallel_world_size(1)
    parallel_state.set_pipeline_model_parallel_rank(0)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)


def _mtp_block_spec(args, config, device: torch.device, split_backward: bool):
    """megatron-core's MTP block, its layer shaped like the model's last layer (dense or MoE), as
    Megatron-LM's GPT builder builds it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    te = uses_transformer_engine(args, device.type)
    last = transformer_config(args, 1, args.num_layers - 1, device.type, split_backward)
    return get_gpt_mtp_block_spec(config, _layer_spec(args, last, device), use_transformer_engine=te)


def mark_tensor_parallel_sums(model, config) -> None:
    """Mark the parameters whose gradients are summed over the tensor-parallel group, by what they are,
    whatever the layer spec (local, Transformer Engine): megatron-core's finalize_model_grads rule.
    Under sequence parallelism, those its layers mark ``sequence_parallel`` (norms, row-parallel
    biases: each rank saw part of the sequence); with --qk-layernorm, the query and key norms, matched
    by name (each rank normalised only its heads)."""
    for name, param in model.named_parameters():
        param.sums_over_tensor_parallel = bool(
            (config.sequence_parallel and getattr(param, "sequence_parallel", False))
            or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)))


def mark_per_head(model) -> None:
    """--softmax-type learnable: the attention sink, one offset per attention head of this rank's share,
    which megatron-core's checkpoint splits over tensor parallelism on axis 0 like the heads but leaves
    unmarked. Marked so, init_chunk draws it whole and slices it like the heads, and the gradient norm
    counts every rank's share (megatron-core's unmarked offset counts TP rank 0's only)."""
    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1


def _splittable_linears(model) -> None:
    """Under a split backward, megatron-core's local linear layers multiply with torch's own ops.
    megatron-core's fused linear function computes the input and the weight gradient together, so I
    and W would each compute both; torch's matmul computes only what each pass asks for (and so no
    gradient-accumulation fusion, which ``fusions_off`` keeps off for these chunks). Transformer Engine's
    layers are not these classes: ``_delayed_weight_gradients`` splits theirs."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module._forward_impl = _linear


def _delayed_weight_gradients(model) -> None:
    """Under a split backward, Transformer Engine's layers (config.delay_wgrad_compute) queue their
    weight-gradient GEMMs during the backward and run them in ``backward_dw()``; each of their parameters
    carries that call as ``delayed_wgrad``, which makes the executor's I the whole backward and its W the
    calls, last layer first (chimera_schedules/runtime/autograd_split.py). Untested with Transformer Engine
    itself (none is installed where the tests run): tests/unit/test_fusions.py stands in for its layers."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    for module in model.modules():
        if isinstance(module, TransformerEngineBaseModule):
            for param in module.parameters(recurse=False):
                param.delayed_wgrad = module.backward_dw


def _linear(input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group=None, **_):
    """megatron-core's linear_with_grad_accumulation_and_async_allreduce, as separate autograd nodes:
    gather the sequence (reduce-scatter its gradient) or all-reduce the input gradient over the
    tensor-parallel group, then the matrix multiply."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    output = torch.matmul(input, weight.t())
    return output if bias is None else output + bias


def global_name(name: str, layer_offset: int, tied: bool, first_expert: int = 0) -> str:
    """The parameter's name in the whole (unsplit) model: layers numbered in the model, and experts
    among all experts (``first_expert``: this expert-parallel rank's first)."""
    if tied and name == "output_layer.weight":
        return TIED_NAME
    name = LOCAL_EXPERT.sub(lambda m: f".experts.local_experts.{int(m.group(1)) + first_expert}.", name)
    name = GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + first_expert}", name)
    return LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


def _tensor_parallel(gname: str) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group that splits this parameter: the expert-tensor-parallel
    one for routed experts (--expert-tensor-parallel-size), the tensor-parallel one otherwise."""
    from megatron.core import parallel_state as ps

    if LOCAL_EXPERT.search(gname) or GROUPED_EXPERT.search(gname):
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def first_local_expert(args) -> int:
    from megatron.core import parallel_state

    if args.num_experts is None:
        return 0
    return parallel_state.get_expert_model_parallel_rank() * (args.num_experts // args.expert_model_parallel_size)


def init_chunk(model, args, layer_offset: int) -> None:
    tied = not args.untie_embeddings_and_output_weights
    scaled_std = args.init_method_std / math.sqrt(2.0 * args.num_layers)
    first_expert = first_local_expert(args)
    with torch.no_grad():
        for name, param in model.named_parameters():
            gname = global_name(name, layer_offset, tied, first_expert)
            param.global_name = gname
            if "norm" in gname:  # zero-centred gamma (--apply-layernorm-1p) stores gamma - 1
                one = 0.0 if args.layernorm_zero_centered_gamma else 1.0
                param.fill_(one if gname.endswith("weight") else 0.0)
                continue
            if gname.endswith("bias"):
                param.zero_()
                continue
            std = scaled_std if gname.endswith(("linear_proj.weight", "linear_fc2.weight")) else args.init_method_std
            shape, (tp, tp_rank) = list(param.shape), _tensor_parallel(gname)
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
            if dim >= 0:
                shape[dim] *= tp
            g = torch.Generator().manual_seed(zlib.crc32(f"{args.seed}/{gname}".encode()))
            full = torch.empty(shape).normal_(0.0, std, generator=g)
            param.copy_(tp_shard(full, dim, tp, tp_rank, gated=is_gated(args, gname)))


def is_gated(args, gname: str) -> bool:
    """Whether the parameter is a gated MLP's fc1 ([gate; up]): --swiglu or --quick-geglu."""
    return (args.swiglu or args.quick_geglu) and gname.endswith("linear_fc1.weight")


def tp_shard(full: torch.Tensor, dim: int, tp: int, rank: int, gated: bool) -> torch.Tensor:
    """This rank's slice of a full tensor. A gated fc1 is [gate; up] in one process, and each
    tensor-parallel rank holds [its gate rows; its up rows]."""
    if dim < 0:
        return full
    if gated:
        return torch.cat([half.chunk(tp, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(tp, dim)[rank]
