"""Model chunks: one megatron-core GPTModel per (pipeline, stage) copy this worker holds.

A chunk of model stage s holds what the run plan's layout gives it (``chimera_schedules.ir.layout``):
its layers, contiguous in the model, and the embedding, MTP layers and output layer where the layout
puts them. It is built as a GPTModel of just those layers whose config says "no pipeline" (so
megatron-core neither offsets its layers nor ties its embedding with collectives); pre_process and
post_process mark the stages holding E and L. Its config is the run's (config/model_spec.py: Megatron-LM's
own) with only what is the chunk's replaced (``transformer_config``).

Initialisation is a function of (seed, global parameter name: parameter_names.py) only: every tensor is
drawn from a generator seeded with both, at its full (unsharded) shape, then sliced to this rank's
tensor-parallel shard. So every copy of a stage, in every pipeline and layout, and the one-process reference start
from the same weights without any broadcast; the tied output layer is drawn under the input
embedding's name. Distributions are Megatron's: the config's init methods for weights (normal(0, std),
std / sqrt(2 L) for the output projections of attention and MLP, --embedding-init-method-std for the
embeddings), ones and zeros for norms, zeros for biases.
"""
from __future__ import annotations

import contextlib
import dataclasses
import zlib

import torch
from megatron.core import parallel_state
from megatron.core import utils as megatron_core_utils  # a module: tests stand in for its get_te_version
from megatron.core.config import set_experimental_flag
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.gpt.gpt_layer_specs import (
    LNImpl,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe import moe_utils  # a module: tests stand in for its fused kernels
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from packaging.version import Version

from ..config.model_spec import ModelSpec
from . import kernels, recompute
from .context_parallel import GatheredKeyValueAttention
from .parameter_names import GROUPED_EXPERT, LOCAL_EXPERT, global_name, is_gated, tp_shard

# TransformerConfig's fusion fields, which Megatron-LM sets from its fusion flags (--no-gradient-accumulation-fusion,
# --no-bias-swiglu-fusion / --no-bias-gelu-fusion, --no-bias-dropout-fusion, --no-rope-fusion,
# --no-masked-softmax-fusion, --no-persist-layer-norm, --moe-permute-fusion, --moe-router-fusion)
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
           "masked_softmax_fusion", "persist_layer_norm", "moe_permute_fusion", "moe_router_fusion")
# What a chunk's config describes as a model of its own, with no pipeline (see the module docstring)
ONE_STAGE = {"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
             "pipeline_model_parallel_layout": None, "num_layers_in_first_pipeline_stage": None,
             "num_layers_in_last_pipeline_stage": None, "account_for_embedding_in_pipeline_split": False,
             "account_for_loss_in_pipeline_split": False}
# megatron-core's own schedules batch their pipeline p2p, as the communicator warm-up expects
# (distributed/warmup.py): Megatron-LM overlaps it instead under its interleaved schedule, which then
# sends and receives between each pair of ranks apart from the pipeline group's communicator
BATCHED_P2P = {"overlap_p2p_comm": False, "batch_p2p_comm": True}
# --recompute-modules that only Transformer Engine's layers recompute: the activation of its grouped experts
# (TEGroupedMLP); megatron-core's local experts (SequentialMLP) have no such checkpoint
TE_RECOMPUTE = ("moe_act",)


def uses_transformer_engine(transformer_impl: str, device_type: str) -> bool:
    """Transformer Engine's layers on a GPU where it is installed with its PyTorch part (model/kernels.py),
    unless --transformer-impl local."""
    return device_type == "cuda" and transformer_impl == "transformer_engine" and kernels.transformer_engine_usable()


def transformer_engine_version() -> str:
    """The installed Transformer Engine's version as megatron-core reads it ("0.0.0" without one)."""
    return str(megatron_core_utils.get_te_version())


def te_at_least(version: str) -> bool:
    """Whether the installed Transformer Engine is ``version`` or later, as megatron-core's own checks ask."""
    return Version(transformer_engine_version()) >= Version(version)


def delayed_wgrad_te(overlap_grad_reduce: bool, gradient_accumulation_fusion: bool) -> str:
    """The Transformer Engine release whose layers can run a split backward (B with their weight gradients
    delayed, W as their ``backward_dw()``) under these flags, by Megatron-LM's own rule for
    delay_wgrad_compute: 2.3 brought it; 2.7 without gradient-accumulation fusion (before it, TE hands
    autograd uninitialised weight-gradient buffers in B, which a hook would add); 2.8 with
    --overlap-grad-reduce."""
    if overlap_grad_reduce:
        return "2.8.0"
    return "2.3.0" if gradient_accumulation_fusion else "2.7.0"


def delays_weight_gradients(overlap_grad_reduce: bool, gradient_accumulation_fusion: bool) -> bool:
    return te_at_least(delayed_wgrad_te(overlap_grad_reduce, gradient_accumulation_fusion))


def _masked_softmax_fusion_missing(config: TransformerConfig, te: bool) -> str | None:
    if te:
        return None
    if config.window_size is not None:  # megatron-core's fused softmax would attend past the window
        return "megatron-core's fused masked softmax ignores --window-size"
    if all(map(kernels.importable, kernels.SOFTMAX_KERNELS)):
        return None
    return "megatron-core's local attention needs apex's fused softmax"


def fusions_off(spec: ModelSpec, device_type: str, split_backward: bool = False) -> dict[str, str]:
    """Each fusion Megatron-LM's config turns on (the run's, ``spec.config``) that stays off here, and why: on
    the CPU all of them (their kernels are CUDA's); on a GPU those megatron-core cannot run here (its kernel
    is not installed, model/kernels.py, or its own rules exclude the case: Megatron-LM fails on these
    instead), and the gradient-accumulation fusion of megatron-core's local linears under a split backward,
    which multiply with torch's own ops there (``_splittable_linears``) so that I and W each compute only
    their part."""
    config = spec.config
    asked = [field for field in FUSIONS if getattr(config, field)]
    if device_type != "cuda":
        return dict.fromkeys(asked, "on the CPU: their kernels are CUDA's")
    te = uses_transformer_engine(config.transformer_impl, device_type)
    missing = {"gradient_accumulation_fusion": _gradient_accumulation_fusion_missing(te, split_backward),
               "apply_rope_fusion": _rope_fusion_missing(config),
               "masked_softmax_fusion": _masked_softmax_fusion_missing(config, te),
               "persist_layer_norm": None if te else _persistent_layer_norm_missing(),
               "moe_permute_fusion": _permute_fusion_missing(),
               "moe_router_fusion": _router_fusion_missing()}
    return {field: missing[field] for field in asked if missing.get(field)}


def _gradient_accumulation_fusion_missing(te: bool, split_backward: bool) -> str | None:
    if split_backward and not te:
        return "a split backward's local linears multiply with torch's own ops"
    if not kernels.importable(kernels.WEIGHT_GRADIENT_KERNEL):  # the output layer is always megatron-core's
        return "megatron-core's linears need apex's fused_weight_gradient_mlp_cuda"
    return None


def _persistent_layer_norm_missing() -> str | None:
    if kernels.apex_missing():
        return "megatron-core's local norms without apex are torch's, which have no persistent kernel"
    if not kernels.importable(kernels.PERSISTENT_LAYER_NORM):  # megatron-core would fall back silently
        return "apex's persistent layer norm (its fast_layer_norm extension) is not built"
    return None


def _permute_fusion_missing() -> str | None:
    """megatron-core's own check (TransformerConfig.__post_init__): Transformer Engine's permutation kernels."""
    if None in (moe_utils.fused_permute, moe_utils.fused_permute_with_probs, moe_utils.fused_sort_chunks_by_index,
                moe_utils.fused_sort_chunks_by_index_with_probs, moe_utils.fused_unpermute):
        return "needs Transformer Engine's permutation kernels (2.1 or later)"
    return None


def _router_fusion_missing() -> str | None:
    """megatron-core's rule for moe_router_fusion (moe/moe_utils.py), which it checks only when the router runs:
    Transformer Engine's fused top-k and auxiliary-loss kernels (its score functions and load balancing that
    have none, sqrtsoftplus and quantile balancing, are refused: config/flag_classes.py's VALUES)."""
    if None in (moe_utils.fused_topk_with_score_function, moe_utils.fused_compute_score_for_moe_aux_loss,
                moe_utils.fused_moe_aux_loss):
        return "needs Transformer Engine's fused router (2.7 or later)"
    return None


def _rope_fusion_missing(config: TransformerConfig) -> str | None:
    """megatron-core's own rules for apply_rope_fusion (TransformerConfig, MLATransformerConfig)."""
    if rope_utils.fused_apply_rotary_pos_emb is None:
        return "needs Transformer Engine's fused RoPE"
    if config.multi_latent_attention and config.rope_type == "rope":
        return "megatron-core fuses multi-latent attention's RoPE for YaRN only"
    if config.rotary_interleaved and not config.multi_latent_attention and not te_at_least("2.3.0"):
        return "interleaved RoPE needs Transformer Engine 2.3 or later"
    return None


def fusion_fields(spec: ModelSpec, device_type: str, split_backward: bool = False) -> dict[str, bool]:
    """The fusion fields of a chunk's TransformerConfig: Megatron-LM's, but those ``fusions_off`` keeps off."""
    off = fusions_off(spec, device_type, split_backward)
    return {field: getattr(spec.config, field) and field not in off for field in FUSIONS}


def _layer_spec(config: TransformerConfig):
    """Transformer Engine's spec where the chunk's config says so (``uses_transformer_engine``), megatron-core's
    local spec otherwise; with --num-experts, each layer dense or mixture-of-experts as ``config.moe_layer_freq``
    says."""
    if config.num_layers == 0:  # a stage of only E, m or L: the block's final norm and no layer
        # (delay_wgrad_compute, set after construction, would fail the probe's __post_init__)
        probe = dataclasses.replace(config, num_layers=1, delay_wgrad_compute=False,
                                    **({"moe_layer_freq": 1} if config.num_moe_experts else {}))
        spec = _layer_spec(probe)  # a block (local norms, MoE), or Transformer Engine's layer
        return dataclasses.replace(spec, layer_specs=[]) if hasattr(spec, "layer_specs") else _block([])
    te = config.transformer_impl == "transformer_engine"
    if config.num_moe_experts is not None:
        specs = get_gpt_decoder_layer_specs(config, te, normalization=config.normalization,
                                            qk_l2_norm=config.qk_l2_norm)
        return _block(specs) if te else _with_local_norms(_gathered_attention(specs, config), config)
    mla = config.multi_latent_attention
    if te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, multi_latent_attention=mla,
                                                          qk_l2_norm=config.qk_l2_norm)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization,
                                    multi_latent_attention=mla, qk_l2_norm=config.qk_l2_norm)
    return _with_local_norms(_gathered_attention([spec] * config.num_layers, config), config)


def _gathered_attention(specs: list, config) -> list:
    """With context parallelism in megatron-core's local layers, whose attention refuses it: the local
    attention over keys and values gathered from the CP ranks (context_parallel.py)."""
    if config.context_parallel_size > 1:
        for spec in {id(spec): spec for spec in specs}.values():
            spec.submodules.self_attention.submodules.core_attention = GatheredKeyValueAttention
    return specs


def _block(specs: list, norm=None):
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm or TENorm)


def _with_local_norms(specs: list, config):
    """Without apex the local spec uses torch's norms, which megatron-core refuses with zero-centred
    gamma (--apply-layernorm-1p) and with sequence parallelism. LocalNorm does both; the final norm
    goes in through the block spec."""
    if not _torch_norm(specs[0].submodules.input_layernorm):
        return _block(specs, LNImpl)  # apex's FusedLayerNorm has both
    for spec in {id(spec): spec for spec in specs}.values():
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = LocalNorm
        attention = layer.self_attention.submodules
        if hasattr(attention, "kv_layernorm"):  # multi-latent attention
            layer.self_attention.module = LatentSelfAttention
            attention.core_attention = LatentCoreAttention
            if _torch_norm(attention.kv_layernorm):  # norms of the latents, whole vectors; no query
                attention.kv_layernorm = LocalNorm  # latent without --q-lora-rank, so no norm of it
                attention.q_layernorm = LocalNorm if config.q_lora_rank is not None else IdentityOp
        elif _torch_norm(attention.q_layernorm):
            attention.q_layernorm = attention.k_layernorm = HeadNorm
    return _block(specs, LocalNorm)


def _torch_norm(norm) -> bool:
    """A norm of the local spec that is torch's: WrappedTorchNorm, or FusedLayerNorm where apex is not
    NVIDIA's with its kernels (megatron-core picks it when any package named apex imports, and it would
    fail when built)."""
    return norm is WrappedTorchNorm or (norm is FusedLayerNorm and kernels.apex_missing() is not None)


class LatentSelfAttention(MLASelfAttention):
    """megatron-core's multi-latent attention on its local layers, with the key's position part summed over
    tensor parallelism. The local spec's key-value down projection is column-parallel: megatron-core gathers
    its output, and every tensor-parallel rank uses the whole position part of the key for its own heads, but
    the gather's backward keeps each rank's own columns of its own gradient, so the position columns lose
    the other ranks' heads. Here the output is gathered as Transformer Engine's duplicated projection would
    give it (sequence-split under sequence parallelism, which megatron-core then gathers with a summing
    backward), and without sequence parallelism the position part's gradient is summed over TP."""

    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        config = self.config
        if kv_combined.size(-1) == config.kv_lora_rank + config.qk_pos_emb_head_dim:
            return q_compressed, kv_combined  # no tensor parallelism
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
        if config.sequence_parallel:
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined)
        latent, position = kv_combined.split([config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        return q_compressed, torch.cat([latent, copy_to_tensor_model_parallel_region(position)], dim=-1)


class LatentCoreAttention(DotProductAttention):
    """megatron-core's local attention for multi-latent attention, whose keys and values have head
    sizes of their own (``k_channels``, ``v_channels``): 0.19's local attention takes neither (Transformer
    Engine's does), though its arithmetic follows the tensors' shapes but for the output's width."""

    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(config, *args, **kwargs)
        if v_channels is not None:  # megatron-core's Attention first builds one without them
            self.hidden_size_per_partition = (v_channels * config.num_attention_heads
                                              // config.tensor_model_parallel_size)


def moe_layer_pattern(config: TransformerConfig) -> list[int] | None:
    """Per layer of the config's model, 1 for mixture-of-experts and 0 for dense (--moe-layer-freq: one
    in every N, or the list itself, as megatron-core reads it); None without --num-experts."""
    if config.num_moe_experts is None:
        return None
    freq = config.moe_layer_freq
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]


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


def _layer_pattern(config: TransformerConfig, first_layer: int, num_layers: int) -> dict:
    """The fields megatron-core reads by layer number, for a chunk's layers. It numbers layers through the
    whole model in Megatron-LM (after the pipeline offset) but in a chunk from its first layer: so the chunk
    gets its slice of the model's pattern, as a list. --moe-layer-freq (every layer MoE stays megatron-core's
    1, so a chunk's checkpoint keys stack its layers exactly when the whole model's do), with --window-size,
    --window-attn-skip-freq (1: sliding window; unset, every layer windowed), and --no-rope-freq (1: no RoPE;
    the run's config holds it as a list, megatron-core's reading of a number N: every Nth layer), and
    --cp-comm-type given per layer (a chunk without layers keeps the first, for megatron-core's checks)."""
    fields = {}
    pattern = moe_layer_pattern(config)
    if pattern is not None and config.moe_layer_freq != 1:
        fields["moe_layer_freq"] = pattern[first_layer:first_layer + num_layers]
    if config.window_size is not None and config.window_attn_skip_freq is not None:
        fields["window_attn_skip_freq"] = [
            int(is_layer_window_attention(config.window_size, config.window_attn_skip_freq, first_layer + i + 1))
            for i in range(num_layers)]
    if config.no_rope_freq:
        fields["no_rope_freq"] = config.no_rope_freq[first_layer:first_layer + num_layers]
    if isinstance(config.cp_comm_type, list):
        fields["cp_comm_type"] = config.cp_comm_type[first_layer:first_layer + num_layers] or config.cp_comm_type[0]
    return fields


def te_only_recompute(spec: ModelSpec, transformer_engine: bool) -> list[str]:
    """The --recompute-modules listed that only Transformer Engine's layers recompute, where megatron-core's
    local layers run instead (none under Transformer Engine)."""
    return [] if transformer_engine else [m for m in spec.config.recompute_modules if m in TE_RECOMPUTE]


def shared_expert_overlap(spec: ModelSpec, device_type: str) -> bool:
    """--moe-shared-expert-overlap on a GPU: megatron-core runs the shared experts on a CUDA side stream
    beside the token dispatch. The CPU has one stream: the shared experts run before the router, as without
    the flag, computing the same (megatron-core notes that only the input's gradient sums its two parts in
    another order)."""
    return spec.config.moe_shared_expert_overlap and device_type == "cuda"


def transformer_config(spec: ModelSpec, num_layers: int, first_layer: int = 0, device_type: str = "cpu",
                       split_backward: bool = False) -> TransformerConfig:
    """The config of a chunk of ``num_layers`` layers starting at layer ``first_layer`` of the model, for a
    chunk on ``device_type`` in a run whose plan splits its backward or not: the run's config (Megatron-LM's),
    with only the chunk's own fields replaced. Those are its layers and their slice of the layer patterns; a
    model of one stage (``ONE_STAGE``) whose megatron-core schedules batch their p2p (``BATCHED_P2P``); the
    fusions this device runs (``fusion_fields``); the layers' backend (Transformer Engine's, or megatron-core's
    local layers, without the recomputed modules, grouped GEMMs and shared-expert stream that only a GPU with
    Transformer Engine has); and CPU initialisation, which sets the tensor-parallel attributes (partition_dim,
    ...) that init_chunk and the gradient norm rely on (init_chunk then redraws every tensor)."""
    run = spec.config
    te = uses_transformer_engine(run.transformer_impl, device_type)
    te_only = te_only_recompute(spec, te)
    config = dataclasses.replace(
        run, num_layers=num_layers, **_layer_pattern(run, first_layer, num_layers), **ONE_STAGE, **BATCHED_P2P,
        **fusion_fields(spec, device_type, split_backward),
        transformer_impl="transformer_engine" if te else "local",
        recompute_modules=[m for m in run.recompute_modules if m not in te_only],
        moe_grouped_gemm=run.moe_grouped_gemm and te,  # megatron-core's local experts are sequential
        moe_shared_expert_overlap=shared_expert_overlap(spec, device_type),
        use_cpu_initialization=True, perform_initialization=True)
    # A split backward with Transformer Engine's layers: B queues their weight-gradient GEMMs and W runs them
    # (_delayed_weight_gradients). Set after construction: megatron-core's __post_init__ allows the field
    # only with its own combined-1F1B overlap (--overlap-moe-expert-parallel-comm); our executor runs W itself.
    # With that flag our schedule plan splits the backward itself (model/schedule_plan.py), so it stays off.
    config.delay_wgrad_compute = split_backward and te and not spec.overlap_moe_expert_parallel_comm
    return config


def build_chunk(spec: ModelSpec, plan, stage: int, device: torch.device) -> GPTModel:
    """Model stage ``stage`` of the run plan's layout, as megatron-core's GPTModel: its layers, the
    embedding where the layout puts E, the output layer and loss where it puts L, and megatron-core's
    MTP block where it puts m."""
    recompute.apply()  # --recompute-modules layernorm without Transformer Engine
    held, first = plan.layout.stages[stage], plan.layout.first_layer(stage)
    config = transformer_config(spec, held.layers, first, device.type, plan.split_backward)
    # --enable-experimental: megatron-core's process-wide switch for the code it marks experimental, set as
    # Megatron-LM's set_global_variables sets it, before the model that reads it is built
    set_experimental_flag(spec.enable_experimental)
    with _one_stage_view():
        model = GPTModel(
            config,
            _layer_spec(config),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_sequence_length,
            pre_process=held.embedding,
            post_process=held.loss,
            share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights,
            position_embedding_type=spec.position_embedding_type,
            rotary_percent=spec.rotary_percent,
            rotary_base=spec.rotary_base,
            rope_scaling=spec.rope_scaling,
            rope_scaling_factor=spec.rope_scaling_factor,
            seq_len_interpolation_factor=spec.seq_len_interpolation_factor,
            mtp_block_spec=_mtp_block_spec(spec, config, device.type, plan.split_backward) if held.mtp else None,
        )
    if config.mtp_num_layers and not plan.layout.holds_last_layer(stage):
        model.decoder.final_layernorm = None  # with MTP, megatron-core puts it after the last layer only
    if held.mtp and held.loss and spec.share_embeddings_and_output_weights:
        # tied, megatron-core's stage of MTP and loss computes its logits with its embedding's weight (the
        # copy MTP needs) and keys no output layer in its checkpoint: the unused matrix is not kept
        model.output_layer.weight = None
    _zeroed_placeholder_where_both_uses_meet(model)
    model.stage = stage
    mark_per_head(model)
    mark_tensor_parallel_sums(model, config)
    init_chunk(model, spec, first)
    if plan.split_backward:
        (_delayed_weight_gradients if config.transformer_impl == "transformer_engine" else _splittable_linears)(model)
    return model.to(device, config.params_dtype)  # as Megatron's Float16Module casts the whole chunk


@contextlib.contextmanager
def _one_stage_view():
    """megatron-core's GPTModel asks parallel_state's pipeline rank whether it is the last stage (to
    place MTP), which is wrong for a copy whose stage is not its rank (Chimera's second pipeline,
    DualPipe's V). The chunk is built as the one-stage model its config describes; what it holds is
    the layout's, given explicitly."""
    parallel_state.set_pipeline_model_parallel_world_size(1)
    parallel_state.set_pipeline_model_parallel_rank(0)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)


def _zeroed_placeholder_where_both_uses_meet(model) -> None:
    """megatron-core marks the tied word embedding ``zero_out_wgrad`` in a model of one stage, whose backward
    meets both of its uses, the lookup and the logits: under gradient-accumulation fusion the logits' GEMM
    adds into ``main_grad`` and hands autograd a placeholder, which must be zeros for the lookup's gradient
    summed into it to reach ``main_grad`` (optim/precision.py, unfused_gradient). Built as one stage
    (``_one_stage_view``), every chunk got the mark, and a chunk of one use zeroed a vocabulary-sized
    placeholder and added it into ``main_grad`` on every micro-batch. It keeps the mark only where both uses
    meet (the logits, and E or MTP's lookup): elsewhere it carries none, as Megatron-LM's pipeline stages."""
    lookup = model.pre_process or model.mtp_process
    if not (model.share_embeddings_and_output_weights and model.post_process and lookup):
        for param in model.parameters():
            vars(param).pop("zero_out_wgrad", None)


def _mtp_block_spec(spec: ModelSpec, config: TransformerConfig, device_type: str, split_backward: bool):
    """megatron-core's MTP block, its layer shaped like the model's last layer (dense or MoE), as
    Megatron-LM's GPT builder builds it; its own norms (of the embedding, of the hidden states, the last one)
    LocalNorm where the local spec would give torch's, which refuses sequence parallelism (_with_local_norms)."""
    last = transformer_config(spec, 1, spec.config.num_layers - 1, device_type, split_backward)
    block = get_gpt_mtp_block_spec(config, _layer_spec(last),
                                   use_transformer_engine=config.transformer_impl == "transformer_engine")
    for layer in {id(layer): layer for layer in (block.layer_specs if block else [])}.values():
        for name in ("enorm", "hnorm", "layer_norm"):
            if _torch_norm(getattr(layer.submodules, name)):
                setattr(layer.submodules, name, LocalNorm)
    return block


def mark_tensor_parallel_sums(model, config) -> None:
    """Mark the parameters whose gradients are summed over the tensor-parallel group, by what they are,
    whatever the layer spec (local, Transformer Engine): megatron-core's finalize_model_grads rule.
    Under sequence parallelism, those its layers mark ``sequence_parallel`` (norms, row-parallel
    biases: each rank saw part of the sequence); with --qk-layernorm, the query and key norms, matched
    by name (each rank normalised only its heads). Not multi-latent attention's: its query norm normalises the
    whole latent on every rank (megatron-core's rule, written for per-head norms, would count it TP times)."""
    per_head = config.qk_layernorm and not config.multi_latent_attention
    for name, param in model.named_parameters():
        param.sums_over_tensor_parallel = bool(
            (config.sequence_parallel and getattr(param, "sequence_parallel", False))
            or (per_head and ("q_layernorm" in name or "k_layernorm" in name)))


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
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module._forward_impl = _linear


def _delayed_weight_gradients(model) -> None:
    """Under a split backward, Transformer Engine's layers (config.delay_wgrad_compute) queue their
    weight-gradient GEMMs during the backward and run them in ``backward_dw()``; each of their parameters
    carries that call as ``delayed_wgrad``, which makes the executor's I the whole backward and its W the
    calls, last layer first (chimera_schedules/runtime/autograd_split.py). Only the layers that delay
    (``_delays_weight_gradients``): others' parameters, such as the attention sink of Transformer Engine's
    DotProductAttention (--softmax-type learnable), get their gradients in I with the rest of the backward.
    Untested with Transformer Engine itself (none is installed where the tests run):
    tests/unit/test_fusions.py stands in for its layers."""
    for module in model.modules():
        if _delays_weight_gradients(module):
            for param in module.parameters(recurse=False):
                param.delayed_wgrad = module.backward_dw


def _delays_weight_gradients(module) -> bool:
    """Transformer Engine's own test of a layer that delays (its need_backward_dw): a weight-gradient store
    that delays. Its linears (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear) have one, enabled by
    delay_wgrad_compute; its DotProductAttention has none, and its backward_dw before 2.10 fails on that."""
    store = getattr(module, "wgrad_store", None)
    return store is not None and store.delay_wgrad_compute()


def _linear(input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group=None, **_):
    """megatron-core's linear_with_grad_accumulation_and_async_allreduce, as separate autograd nodes:
    gather the sequence (reduce-scatter its gradient) or all-reduce the input gradient over the
    tensor-parallel group, then the matrix multiply."""
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    output = torch.matmul(input, weight.t())
    return output if bias is None else output + bias


def _tensor_parallel(gname: str) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group that splits this parameter: the expert-tensor-parallel
    one for routed experts (--expert-tensor-parallel-size), the tensor-parallel one otherwise."""
    if LOCAL_EXPERT.search(gname) or GROUPED_EXPERT.search(gname):
        return parallel_state.get_expert_tensor_parallel_world_size(), parallel_state.get_expert_tensor_parallel_rank()
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def first_local_expert(config: TransformerConfig) -> int:
    if config.num_moe_experts is None:
        return 0
    per_rank = config.num_moe_experts // config.expert_model_parallel_size
    return parallel_state.get_expert_model_parallel_rank() * per_rank


def init_method(config: TransformerConfig, gname: str):
    """megatron-core's init method for a weight of the whole model's config, by the weight's global name: the
    embeddings' (--embedding-init-method-std), the output projections' of attention and MLP (std / sqrt(2 L)),
    the others' (the untied output layer's too)."""
    if gname.startswith("embedding."):
        return config.embedding_init_method
    if gname.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return config.output_layer_init_method
    return config.init_method


def init_chunk(model, spec: ModelSpec, layer_offset: int) -> None:
    config = spec.config
    tied = spec.share_embeddings_and_output_weights
    first_expert = first_local_expert(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            gname = global_name(name, layer_offset, tied, first_expert)
            param.global_name = gname
            if "norm" in gname:  # zero-centred gamma (--apply-layernorm-1p) stores gamma - 1
                one = 0.0 if config.layernorm_zero_centered_gamma else 1.0
                param.fill_(one if gname.endswith("weight") else 0.0)
                continue
            if gname.endswith("bias"):
                param.zero_()
                continue
            shape, (tp, tp_rank) = list(param.shape), _tensor_parallel(gname)
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
            if dim >= 0:
                shape[dim] *= tp
            g = torch.Generator().manual_seed(zlib.crc32(f"{spec.seed}/{gname}".encode()))
            full = init_method(config, gname)(torch.empty(shape), generator=g)
            param.copy_(tp_shard(full, dim, tp, tp_rank, gated=is_gated(config, gname)))
