"""Megatron-LM's model-architecture flags: derived from megatron-core's TransformerConfig, mapped as
Megatron-LM maps them, the no-op ones accepted, mixture of experts refused in one line."""
import dataclasses

import pytest
import torch

from megatron.chimera.config.arguments import _parser, parse_args
from megatron.chimera.model.chunk import transformer_config
from megatron.chimera.model.flags import ARCHITECTURE, MOE, NO_EFFECT, flag

BASE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--vocab-size", "1000"]
# Megatron-LM's Llama-3 8B recipe (examples/llama), model block, scaled down; --apply-layernorm-1p needs apex
LLAMA = ["--use-mcore-models", "--ffn-hidden-size", "512", "--group-query-attention", "--num-query-groups", "4",
         "--kv-channels", "32", "--position-embedding-type", "rope", "--rotary-base", "1000000",
         "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
         "--init-method-std", "0.0134", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--no-masked-softmax-fusion"]


def test_every_architecture_flag_takes_its_default_from_transformer_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    parser = _parser()
    for name in ARCHITECTURE:
        action = next(a for a in parser._actions if flag(name) in a.option_strings)
        assert action.default == (defaults[name] if not isinstance(defaults[name], bool) else False), name


def test_llama_recipe_flags_reach_megatron_cores_config():
    args = parse_args(BASE + LLAMA)
    config = transformer_config(args, 2)
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == 1e-5
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    assert (config.num_query_groups, config.kv_channels, config.ffn_hidden_size) == (4, 32, 512)
    assert not config.add_bias_linear and config.init_method_std == 0.0134
    assert (args.position_embedding_type, args.rotary_base) == ("rope", 1000000)


def test_megatron_lm_defaults_for_derived_settings():
    args = parse_args(BASE + ["--swiglu", "--num-query-groups", "2"])
    assert args.ffn_hidden_size == 640  # 2/3 of 4h, rounded down to 64, as Megatron-LM
    assert args.num_query_groups is None  # only with --group-query-attention, as Megatron-LM
    assert parse_args(BASE + ["--no-position-embedding"]).position_embedding_type == "none"
    rope_only = parse_args(BASE + ["--use-rotary-position-embeddings", "--no-position-embedding"])
    assert rope_only.position_embedding_type == "rope"


@pytest.mark.parametrize("extra, needle", [
    (["--num-experts", "8"], "--num-experts: mixture-of-experts models are not supported yet"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups=3: must divide --num-attention-heads"),
    (["--exit-signal", "SIGTERM"], "unrecognized arguments"),  # no abbreviation of --exit-signal-handler
    (["--context-parallel-size", "2"], "--context-parallel-size=2: context parallelism is not supported yet"),
])
def test_unsupported_model_flags_fail_in_one_line(capsys, extra, needle):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + extra)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and needle in err and len(err.splitlines()) == 1, err


def test_sequence_parallel_needs_a_sequence_tp_can_split_and_is_off_at_tp1(capsys):
    assert not parse_args(BASE + ["--sequence-parallel"]).sequence_parallel  # Megatron-LM's rule
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "63"],
                   world_size=2)
    assert "--sequence-parallel=True: needs --seq-length divisible by TP (2)" in capsys.readouterr().err


def test_flags_without_effect_are_accepted_and_say_why():
    args = parse_args(BASE + list(NO_EFFECT))
    assert all(getattr(args, name[2:].replace("-", "_")) for name in NO_EFFECT)
    help_text = _parser().format_help()
    assert all(name in help_text for name in NO_EFFECT) and "no effect:" in help_text
    assert not any(name in help_text for name in MOE)


def test_log_throughput_flops_follow_the_standard_gpt_formula():
    """72 b s L h^2 (1 + s / 6h + V / 12Lh) for a GPT-3-style layer; SwiGLU and GQA change their terms."""
    from types import SimpleNamespace

    from megatron.chimera.observability.flops import iteration_flops

    gpt3 = SimpleNamespace(hidden_size=12288, seq_length=2048, num_layers=96, num_attention_heads=96, kv_channels=None,
                           num_query_groups=None, ffn_hidden_size=4 * 12288, swiglu=False, padded_vocab_size=51200)
    b, s, layers, h, v = 8, 2048, 96, 12288, 51200
    expected = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert abs(iteration_flops(gpt3, b) / expected - 1) < 1e-12


def test_megatron_lm_spellings_of_recomputation_and_virtual_stages():
    args = parse_args(BASE + ["--recompute-activations", "--context-parallel-size", "1"])
    assert args.recompute_granularity == "selective"
    vpp = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved",
                             "--virtual-pipeline-model-parallel-size", "2"], world_size=2)
    assert vpp.num_layers_per_virtual_pipeline_stage == 1 and vpp.schedule.chunks == 2
