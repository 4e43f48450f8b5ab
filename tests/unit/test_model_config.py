"""The model's config is Megatron-LM's own (config/model_spec.py: core_transformer_config_from_args), and each
chunk's config differs from it only in the fields that are the chunk's (model/chunk.py's transformer_config)."""
import dataclasses
import functools

import pytest
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.training.argument_utils import core_transformer_config_from_args

from megatron.chimera.arguments import parse_args
from megatron.chimera.config import model_spec
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.model import chunk
from megatron.chimera.testing.equivalence import MIXTRAL, MODEL, VARIANTS
from megatron.chimera.testing.plans import plan_of

ONE = MODEL + ["--micro-batch-size", "1"]
CHIMERA = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]
MODELS = {"gpt": [], "rope": VARIANTS["rope"], "mixtral": MIXTRAL, "mla": VARIANTS["deepseek-style"],
          # megatron-core appends "moe" to the recomputed modules it is given
          "recomputed-moe": MIXTRAL + ["--moe-layer-recompute", "--recompute-granularity", "selective",
                                       "--recompute-modules", "core_attn"],
          "config-fields": VARIANTS["config-fields"]}
# Every field in which a chunk's config may differ from the run's, and why
CHUNK_OWN = {
    "num_layers": "the chunk's layers",
    "moe_layer_freq": "the chunk's slice of the model's MoE layer pattern (megatron-core numbers a chunk's layers "
                      "from its first)",
    "window_attn_skip_freq": "the chunk's slice of the sliding-window pattern (likewise)",
    "no_rope_freq": "the chunk's slice of the layers without RoPE (likewise)",
    **dict.fromkeys(chunk.ONE_STAGE, "a chunk is built as a model of one stage"),
    **dict.fromkeys(chunk.BATCHED_P2P, "megatron-core's own schedules batch their p2p, as the warm-up expects"),
    **dict.fromkeys(chunk.FUSIONS, "the fusions this device runs"),
    "transformer_impl": "Transformer Engine's layers where installed on a GPU, megatron-core's local ones otherwise",
    "recompute_modules": "the modules only Transformer Engine's layers recompute are left out of local layers",
    "moe_grouped_gemm": "grouped GEMMs are Transformer Engine's",
    "moe_shared_expert_overlap": "the shared experts' CUDA stream, on a GPU only",
    "use_cpu_initialization": "weights are drawn on the CPU, then redrawn by init_chunk",
    "perform_initialization": "megatron-core's initialisation marks the tensor-parallel attributes",
    "delay_wgrad_compute": "Transformer Engine's layers under a split backward",
}


def _same(a, b) -> bool:
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # the init methods
        return (a.func, a.args, a.keywords) == (b.func, b.args, b.keywords)
    return bool(a == b)


def _differing(a, b) -> set[str]:
    return {f.name for f in dataclasses.fields(a) if not _same(getattr(a, f.name), getattr(b, f.name))}


@pytest.fixture
def fused_rope(monkeypatch):
    """Transformer Engine's fused RoPE as far as megatron-core's config asks, so that Megatron-LM's own function
    builds its config here for a model with RoPE (RoPE fusion is on by default)."""
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *args, **kwargs: None)


# Config fields named as a flag that Megatron-LM's core_transformer_config_from_args derives rather than copies
DERIVED = {
    "num_query_groups": "the attention heads' count without --group-query-attention",
    "embedding_init_method_std": "--init-method-std without its own flag",
    "microbatch_group_size_per_vp_stage": "PP without --microbatch-group-size-per-virtual-pipeline-stage",
    "recompute_modules": "['core_attn'] under selective recompute without --recompute-modules",
    "cp_comm_type": "a one-element list's element",
    "rope_type": "MLA's default, yarn, without --rope-type",
}


@pytest.mark.parametrize("name", MODELS)
def test_the_models_config_is_megatron_lms_own(fused_rope, name):
    """Field by field against the flags: each config field named as a flag holds the flag's value (as Megatron-LM
    copies them), but those ``DERIVED`` and those the model spec sets apart (NO_EFFECT and KERNEL_CHECKED, whose
    values the spec's docstring gives); and against Megatron-LM's own config for the derived ones and for the
    fields named otherwise. A field the spec dropped or set apart unsaid fails here, named."""
    args = parse_args(ONE + MODELS[name], world_size=1)
    before = {key: repr(value) for key, value in vars(args).items()}
    spec = ModelSpec.from_args(args)
    assert {key: repr(value) for key, value in vars(args).items()} == before, "ModelSpec wrote to the namespace"
    megatron = core_transformer_config_from_args(args)
    assert type(spec.config) is type(megatron), name
    named = {f.name for f in dataclasses.fields(spec.config) if hasattr(args, f.name)}
    assert len(named) > 200, f"only {len(named)} config fields are named as flags"
    set_apart = {**model_spec.NO_EFFECT, **{f: getattr(args, f) for f in model_spec.KERNEL_CHECKED}}
    want = {f: set_apart.get(f, getattr(megatron, f) if f in DERIVED else getattr(args, f)) for f in named}
    wrong = {f: (getattr(spec.config, f), want[f]) for f in named if not _same(getattr(spec.config, f), want[f])}
    assert not wrong, f"{name}: config fields (held, the flag's value): {wrong}"
    others = _differing(spec.config, megatron) - named
    assert not others, f"{name}: fields named otherwise than a flag differ from Megatron-LM's config: {others}"
    assert (spec.vocab_size, spec.share_embeddings_and_output_weights) == (128, True)


def test_mla_picks_megatron_cores_latent_config():
    config = ModelSpec.from_args(parse_args(ONE + VARIANTS["deepseek-style"], world_size=1)).config
    assert isinstance(config, MLATransformerConfig) and (config.q_lora_rank, config.kv_lora_rank) == (16, 16)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_chunks_config_differs_from_the_runs_only_in_its_own_fields(name, device_type):
    args = parse_args(ONE + MODELS[name] + CHIMERA, world_size=2)
    spec, plan = ModelSpec.from_args(args), plan_of(args)
    for stage, held in enumerate(plan.layout.stages):
        first = plan.layout.first_layer(stage)
        config = chunk.transformer_config(spec, held.layers, first, device_type, plan.split_backward)
        assert _differing(config, spec.config) <= set(CHUNK_OWN), _differing(config, spec.config) - set(CHUNK_OWN)
        assert (config.num_layers, config.pipeline_model_parallel_size) == (held.layers, 1)
        pattern = chunk.moe_layer_pattern(spec.config)
        if pattern is not None and spec.config.moe_layer_freq != 1:
            assert config.moe_layer_freq == pattern[first:first + held.layers]


def test_overlapped_expert_communication_stays_out_of_megatron_cores_config():
    """--overlap-moe-expert-parallel-comm runs our executor's schedule plans: megatron-core's rules for its own
    combined 1F1B (virtual stages, bf16) do not apply, so its field stays off and the flag is the spec's."""
    moe = ["--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall",
           "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"]
    spec = ModelSpec.from_args(parse_args(ONE + CHIMERA + moe, world_size=4))
    assert spec.overlap_moe_expert_parallel_comm and not spec.config.overlap_moe_expert_parallel_comm
    assert not chunk.transformer_config(spec, 4, 0, "cpu", split_backward=True).delay_wgrad_compute


def test_attention_softmax_in_fp32_is_megatron_lms_flag():
    """Megatron-LM's config computes the attention softmax in the activations' precision unless
    --attention-softmax-in-fp32 (megatron-core's own default, True, is not Megatron-LM's)."""
    assert not ModelSpec.from_args(parse_args(ONE + ["--bf16"], world_size=1)).config.attention_softmax_in_fp32
    spec = ModelSpec.from_args(parse_args(ONE + ["--bf16", "--attention-softmax-in-fp32"], world_size=1))
    assert chunk.transformer_config(spec, 8).attention_softmax_in_fp32


def test_flags_with_no_effect_here_stay_out_of_the_config(tmp_path):
    """--config-logger-dir (megatron-core would write there), --test-mode (a collective inside attention's forward)
    and --defer-embedding-wgrad-compute (the output layer would keep its weight gradient for megatron-core's
    schedules) have no effect here."""
    flags = ["--config-logger-dir", str(tmp_path), "--test-mode", "--defer-embedding-wgrad-compute",
             "--wgrad-deferral-limit", "2"]
    config = ModelSpec.from_args(parse_args(ONE + MIXTRAL + CHIMERA + flags, world_size=2)).config
    assert config.config_logger_dir == "", config.config_logger_dir
    assert (config.test_mode, config.defer_embedding_wgrad_compute, config.wgrad_deferral_limit) == (False, False, 0)
