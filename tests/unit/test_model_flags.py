"""Megatron-LM's model-architecture flags reach megatron-core's TransformerConfig, with Megatron-LM's
derived settings; impossible values fail in one line."""
import os
from types import SimpleNamespace

import pytest
import torch
from megatron.core.activations import squared_relu
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.training.determinism import DETERMINISM_ENV_VAR_DEFAULTS
from megatron.training.training import num_floating_point_operations

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.config.train_spec import TrainSpec
from megatron.chimera.model import chunk
from megatron.chimera.model.chunk import (
    _layer_spec,
    build_chunk,
    init_method,
    mark_tensor_parallel_sums,
    transformer_config,
)
from megatron.chimera.optim.optimizer import param_groups
from megatron.chimera.testing.cases import process_state_kept
from megatron.chimera.testing.equivalence import VARIANTS
from megatron.chimera.testing.one_step import one_process_trainer
from megatron.chimera.testing.plans import plan_of

BASE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--vocab-size", "1000"]
# Megatron-LM's Llama-3 8B recipe (examples/llama), model block, scaled down; --apply-layernorm-1p needs apex
LLAMA = ["--use-mcore-models", "--ffn-hidden-size", "512", "--group-query-attention", "--num-query-groups", "4",
         "--kv-channels", "32", "--position-embedding-type", "rope", "--rotary-base", "1000000",
         "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
         "--init-method-std", "0.0134", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--no-masked-softmax-fusion"]


def test_llama_recipe_flags_reach_megatron_cores_config():
    args = parse_args(BASE + LLAMA)
    config = transformer_config(ModelSpec.from_args(args), 2)
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == 1e-5
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    assert (config.num_query_groups, config.kv_channels, config.ffn_hidden_size) == (4, 32, 512)
    assert not config.add_bias_linear and config.init_method_std == 0.0134
    assert (args.position_embedding_type, args.rotary_base) == ("rope", 1000000)


def test_megatron_lm_defaults_for_derived_settings():
    args = parse_args(BASE + ["--swiglu", "--num-query-groups", "2"])
    assert args.ffn_hidden_size == 640  # 2/3 of 4h, rounded down to 64, as Megatron-LM
    assert args.num_query_groups is None  # only with --group-query-attention, as Megatron-LM
    rope_only = parse_args(BASE + ["--use-rotary-position-embeddings", "--no-position-embedding"])
    assert rope_only.position_embedding_type == "rope"


@pytest.mark.parametrize("extra, needle", [
    (["--no-position-embedding"], "--no-position-embedding is deprecated, use --position-embedding-type "
                                  "(Megatron-LM's validate_args)"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups=3: must divide --num-attention-heads"),
    (["--exit-signal-handle"], "unrecognized arguments"),  # no abbreviation of --exit-signal-handler
    (["--deterministic-mode", "--cross-entropy-loss-fusion"],
     "--deterministic-mode requires: cross_entropy_loss_fusion=False (got True)"),
    (["--squared-relu", "--swiglu"], "--squared-relu=True: cannot be combined with --swiglu"),
    (["--squared-relu"], "--squared-relu=True: needs --no-bias-gelu-fusion or --disable-bias-linear"),
    (["--qk-l2-norm", "--multi-latent-attention"], "--qk-l2-norm=True: is not supported with --multi-latent"),
    (["--attention-output-gate", "--multi-latent-attention"], "--attention-output-gate=True: is not supported with"),
    (["--no-weight-decay-cond-type", "all"], "--no-weight-decay-cond-type: invalid choice: 'all'"),
    (["--embedding-init-method-std", "-1"], "--embedding-init-method-std=-1.0: must not be negative"),
    (["--no-rope-freq", "3"], "--no-rope-freq=3: must give one entry per layer or a number that divides them"),
    (["--no-rope-freq", "[0]*3"], "--no-rope-freq=[0, 0, 0]: must give one entry per layer"),
    (["--no-rope-freq", "2", "--position-embedding-type", "rope", "--mtp-num-layers", "1"],
     "--mtp-num-layers=1: with --no-rope-freq is not supported yet"),
    (["--ddp-average-in-collective", "--calculate-per-token-loss"],
     "--ddp-average-in-collective=True: cannot be combined with --calculate-per-token-loss"),
    (["--num-distributed-optimizer-instances", "2"],
     "--num-distributed-optimizer-instances=2: must divide the data-parallel size (1)"),
    (["--init-method-xavier-uniform"], "--init-method-xavier-uniform=True: Megatron-LM 0.19 fails with it itself"),
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


def test_log_throughput_flops_follow_the_standard_gpt_formula():
    """--log-throughput counts Megatron-LM's own num_floating_point_operations, which for a GPT-3-style
    layer is 72 b s L h^2 (1 + s / 12h + V / 12Lh): causal attention scores counted half, as 0.19 does."""
    gpt3 = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--vocab-size", "51200"]
    args = parse_args(gpt3, world_size=1)
    b, s, layers, h, v = 8, 2048, 96, 12288, 51200
    expected = 72 * b * s * layers * h * h * (1 + s / (12 * h) + v / (12 * layers * h))
    assert abs(num_floating_point_operations(args, b) / expected - 1) < 1e-12


def test_megatron_lm_spellings_of_recomputation_and_virtual_stages():
    args = parse_args(BASE + ["--recompute-activations", "--context-parallel-size", "1"])
    assert args.recompute_granularity == "selective"
    vpp = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved",
                             "--num-virtual-stages-per-pipeline-rank", "2"], world_size=2)
    assert vpp.num_layers_per_virtual_pipeline_stage == 1 and plan_of(vpp).schedule.virtual_stages == 2


def test_tensor_parallel_sums_are_marked_by_what_a_parameter_is_whatever_the_layer_spec():
    """Transformer Engine's layout: its input norm fused into linear_qkv (marked sequence_parallel by TE),
    its own q/k norms (unmarked: megatron-core matches them by name), a row-parallel bias."""
    marked_by_te = {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": True,
                    "decoder.layers.0.self_attention.linear_proj.bias": True,
                    "decoder.layers.0.self_attention.q_layernorm.weight": False,
                    "decoder.layers.0.self_attention.k_layernorm.weight": False,
                    "decoder.layers.0.mlp.linear_fc1.weight": False}
    model = torch.nn.Module()
    for name, sequence_parallel in marked_by_te.items():
        *path, leaf = name.split(".")
        module = model
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.ones(2)))
        getattr(module, leaf).sequence_parallel = sequence_parallel

    def marks(sequence_parallel, qk_layernorm, latent=False):
        mark_tensor_parallel_sums(model, SimpleNamespace(sequence_parallel=sequence_parallel,
                                                         qk_layernorm=qk_layernorm, multi_latent_attention=latent))
        return {name.split(".", 3)[3] for name, p in model.named_parameters() if p.sums_over_tensor_parallel}

    assert marks(True, True) == {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.bias",
                                 "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    assert marks(False, True) == {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    assert marks(True, False) == {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.bias"}
    assert marks(False, False) == set()
    # multi-latent attention's query norm normalises the whole latent on every rank: summed only as its mark says
    assert marks(False, True, latent=True) == set()


def test_config_field_flags_reach_megatron_cores_config():
    """Flags whose meaning is a TransformerConfig field reach the run's config and every chunk's (the equivalence
    harness's "config-fields" case trains them equal to one process); RoPE's skipped layers as each chunk's
    slice of the model's pattern."""
    args = parse_args(BASE + VARIANTS["config-fields"] + ["--num-layers", "8", "--disable-bias-linear",
                                                          "--pipeline-model-parallel-size", "2",
                                                          "--pipeline-schedule", "chimera"], world_size=2)
    spec = ModelSpec.from_args(args)
    config = spec.config
    assert config.apply_query_key_layer_scaling and config.attention_softmax_in_fp32  # Megatron-LM ties the two
    assert config.attention_output_gate and config.qk_l2_norm and config.activation_func is squared_relu
    assert config.embedding_init_method_std == 0.01 and config.init_method_std == 0.02
    assert init_method(config, "embedding.word_embeddings.weight").keywords["std"] == 0.01
    assert init_method(config, "decoder.layers.0.mlp.linear_fc1.weight").keywords["std"] == 0.02
    assert config.no_rope_freq == [0, 0, 0, 1, 1, 0, 0, 1]
    chunks = [transformer_config(spec, 4, first) for first in (0, 4)]
    assert [c.no_rope_freq for c in chunks] == [[0, 0, 0, 1], [1, 0, 0, 1]]
    attention = _layer_spec(chunks[0]).layer_specs[0].submodules.self_attention.submodules
    assert attention.q_layernorm.__name__ == attention.k_layernorm.__name__ == "L2Norm"
    assert attention.core_attention is DotProductAttention


def test_shared_expert_gate_reaches_megatron_cores_shared_experts(one_process_group):
    """--moe-shared-expert-gate (Qwen3-Next's): megatron-core's SharedExpertMLP scales its output by a sigmoid gate
    of the token, one weight row drawn like the other weights (the harness's "shared-expert-gate" case trains it
    at Chimera D=2 equal to one process)."""
    args = parse_args(BASE + VARIANTS["shared-expert-gate"] + ["--num-layers", "1", "--hidden-size", "64",
                                                                     "--disable-bias-linear", "--num-experts", "2"])
    model_parallel_cuda_manual_seed(args.seed)  # as the Trainer does
    spec = ModelSpec.from_args(args)
    assert spec.config.moe_shared_expert_gate, "the flag did not reach megatron-core's config"
    model = build_chunk(spec, plan_of(args), 0, torch.device("cpu"))
    gate = model.decoder.layers[0].mlp.shared_experts.gate_weight
    assert gate.shape == (1, 64) and gate.global_name.endswith("shared_experts.gate_weight"), gate.global_name
    assert 0.01 < gate.std().item() < 0.03, f"the gate is not drawn with --init-method-std 0.02: {gate.std()}"
    assert not gate.sums_over_tensor_parallel, "without sequence parallelism every TP rank has the same gate gradient"


@pytest.mark.parametrize("extra, needle", [
    (["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2"],
     "--experimental-attention-variant=gated_delta_net: GPU-only: Qwen3-Next's gated delta net"),
    (["--dsa-kernel-backend", "tilelang"],
     "--dsa-kernel-backend=tilelang: GPU-only: DeepSeek's sparse attention (DSA) needs GPU kernels: its fused "
     "indexer and attention are TileLang's or cuDNN's"),
])
def test_linear_and_sparse_attention_variants_are_refused_with_their_reason(capsys, extra, needle):
    with pytest.raises(SystemExit):
        parse_args(BASE + extra)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_deterministic_mode_is_megatron_lms():
    """--deterministic-mode: Megatron-LM's validate_args turns on torch's deterministic algorithms and sets the
    environment of its deterministic tests (where not already set), and megatron-core's config field reaches
    every chunk (its embedding then gathers rows rather than calling F.embedding)."""
    with process_state_kept():
        for key in DETERMINISM_ENV_VAR_DEFAULTS:
            os.environ.pop(key, None)
        args = parse_args(BASE + ["--deterministic-mode"])
        assert torch.are_deterministic_algorithms_enabled(), "torch's deterministic algorithms are off"
        assert {key: os.environ.get(key) for key in DETERMINISM_ENV_VAR_DEFAULTS} == DETERMINISM_ENV_VAR_DEFAULTS
    spec = ModelSpec.from_args(args)
    assert spec.config.deterministic_mode and transformer_config(spec, 2).deterministic_mode
    assert not ModelSpec.from_args(parse_args(BASE)).config.deterministic_mode


def test_deterministic_mode_refuses_a_nondeterministic_nccl_algorithm(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--deterministic-mode"])
    err = capsys.readouterr().err.strip()
    assert "NCCL_ALGO='Tree': each token must be in" in err and len(err.splitlines()) == 1, err


def test_te_rng_tracker_reaches_the_seeding():
    assert TrainSpec.from_args(parse_args(BASE + ["--te-rng-tracker"])).te_rng_tracker
    assert not TrainSpec.from_args(parse_args(BASE)).te_rng_tracker


def _layer(names: dict[str, int]) -> torch.nn.Module:
    """A module holding a parameter of ``dims`` dimensions under each name of layer 0."""
    root = torch.nn.Module()
    for name, dims in names.items():
        *path, leaf = ("decoder.layers.0." + name).split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, torch.nn.Parameter(torch.ones([2] * dims)))
    return root


@pytest.mark.parametrize("flags", [["--apply-wd-to-qk-layernorm"], ["--no-weight-decay-cond-type",
                                                                      "apply_wd_to_qk_layernorm"]])
def test_weight_decay_on_the_query_and_key_norms_is_megatron_cores_rule(one_process_group, flags):
    """Megatron's rule: no weight decay on 1-D parameters (norms, biases), but on the query and key norms with
    --apply-wd-to-qk-layernorm (or its deprecated spelling)."""
    layer = _layer({"self_attention.q_layernorm.weight": 1, "self_attention.k_layernorm.bias": 1,
                    "input_layernorm.weight": 1, "self_attention.linear_qkv.weight": 2})
    named = {id(p): name for name, p in layer.named_parameters()}

    def decayed(argv):
        groups = param_groups([layer], [(p, p) for p in layer.parameters()],
                              TrainSpec.from_args(parse_args(BASE + argv)).optimizer)
        return {named[id(p)].split(".")[-2] for g in groups if g["wd_mult"] for p in g["params"]}

    assert decayed([]) == {"linear_qkv"}
    assert decayed(flags) == {"linear_qkv", "q_layernorm", "k_layernorm"}


@pytest.mark.parametrize("distributed", [[], ["--use-distributed-optimizer", "--bf16"]])
def test_parameter_groups_follow_the_model_parameters_the_main_weights_stand_for(one_process_group, distributed):
    """Each main parameter (an fp32 copy, a piece of the distributed optimizer) in its model parameter's group:
    weight decay on the matrices only; --decoupled-lr's schedule for the embedding and output layer only, the
    others on the scheduler's own --lr and --min-lr (so that a loaded schedule applies to them)."""
    flags = BASE + distributed + ["--untie-embeddings-and-output-weights", "--decoupled-lr", "5e-4",
                                  "--eval-iters", "0"]
    with one_process_trainer(flags) as t:
        for group in t.optimizer.param_groups:
            for model, main in t.main.stepped():
                if any(main is p for p in group["params"]):
                    own = getattr(model, "is_embedding_or_output_parameter", False)
                    assert group["wd_mult"] == (1.0 if model.dim() > 1 else 0.0), f"{model.global_name}: weight decay"
                    assert group.get("max_lr") == (5e-4 if own else None), f"{model.global_name}: {group.get('max_lr')}"
                    assert group.get("min_lr") == (0.0 if own else None), f"{model.global_name}: {group.get('min_lr')}"
        stepped = sum(len(g["params"]) for g in t.optimizer.param_groups)
        assert stepped == len(t.main.stepped()), "a main parameter in no group, or in two"


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_multi_latent_attention_with_tensor_parallelism_in_transformer_engine_needs_sequence_parallelism(
        capsys, monkeypatch, sequence_parallel):
    """megatron-core 0.19's duplicated key-value down projection (Transformer Engine's) sums the key's position
    gradient over TP only under sequence parallelism; its local layers are corrected (model/chunk.py)."""
    monkeypatch.setattr(chunk, "uses_transformer_engine", lambda impl, device: True)
    flags = BASE + ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8",
                    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--position-embedding-type", "rope",
                    "--tensor-model-parallel-size", "2"] + (["--sequence-parallel"] if sequence_parallel else [])
    if sequence_parallel:
        assert parse_args(flags, world_size=2).multi_latent_attention
        return
    with pytest.raises(SystemExit):
        parse_args(flags, world_size=2)
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretrain_gpt.py: error: --sequence-parallel=False: is required with "
                          "--multi-latent-attention and tensor parallelism in Transformer Engine's layers"), err
