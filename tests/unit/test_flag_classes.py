"""Every flag Megatron-LM's parser defines is in exactly one class, pretrain_gpt.py --help lists them
all, and a refused flag fails in one line naming it (megatron/chimera/config/flag_classes.py)."""
import os

import pytest

from megatron.chimera.arguments import parse_args
from megatron.chimera.config import flag_classes
from megatron.chimera.config.flag_table import DEFAULT_OUT, megatron_parser, render
from megatron.chimera.testing.plans import plan_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--vocab-size", "1000"]


def megatron_options() -> set[str]:
    return {o for a in megatron_parser()._actions for o in a.option_strings if o.startswith("--")}


def test_every_megatron_lm_flag_has_exactly_one_class():
    classes = [flag_classes.HONOURED, *flag_classes.NO_EFFECT.values(), *flag_classes.REFUSED.values()]
    seen = [o for options in classes for o in options]
    assert len(seen) == len(set(seen)), sorted({o for o in seen if seen.count(o) > 1})
    options = megatron_options()
    assert not options - set(seen), f"Megatron-LM flags with no class: {sorted(options - set(seen))}"
    assert not set(seen) - options, f"classes name flags Megatron-LM does not define: {sorted(set(seen) - options)}"
    assert set(flag_classes.VALUES) <= flag_classes.HONOURED


def test_help_prints_every_megatron_lm_flag_with_its_class(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert exit_info.value.code == 0
    assert all(o in text for o in megatron_options()), f"missing: {[o for o in megatron_options() if o not in text]}"
    assert "[refused here: hybrid (dynamic) context parallelism's bound on the tokens per DP x CP rank" in text
    assert "[honoured here for allgather, alltoall, flex only]" in text
    assert "--pipeline-schedule" in text and "--chimera-concat" in text


def test_flag_table_is_generated_from_the_classes():
    with open(os.path.join(ROOT, DEFAULT_OUT)) as f:
        assert f.read() == render(megatron_parser()), "run python -m megatron.chimera.config.flag_table"


def test_the_optimizer_step_gather_overlap_parses_under_chimera(capsys):
    """--overlap-param-gather-with-optimizer-step, as Megatron-LM's interleaved configurations give it, parses
    moved to Chimera (no virtual stages, which Megatron-LM's own check of it asks for) and is named as having
    no effect here (its reason: when the gathers start, not what they compute)."""
    args = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
                              "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                              "--overlap-param-gather-with-optimizer-step"], world_size=4)
    said = [line for line in capsys.readouterr().out.splitlines() if "flags with no effect here" in line]
    assert args.overlap_param_gather_with_optimizer_step and len(said) == 1 and \
        "--overlap-param-gather-with-optimizer-step" in said[0], said


@pytest.mark.parametrize("extra, line", [
    (["--num-experts", "8", "--disable-bias-linear", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size=2: x --expert-tensor-parallel-size (1) must divide TP x CP x DP = 1 x 1 x 1"),
    (["--num-experts", "6", "--disable-bias-linear", "--expert-model-parallel-size", "4"],
     "--num-experts=6: must be a multiple of --expert-model-parallel-size (4)"),
    (["--num-experts", "8", "--disable-bias-linear", "--moe-router-topk", "9"],
     "--moe-router-topk=9: must be between 1 and --num-experts (8)"),
    (["--num-experts", "8", "--disable-bias-linear", "--moe-router-num-groups", "4", "--moe-router-group-topk", "1",
      "--moe-router-topk", "3"], "--moe-router-topk=3: is greater than the experts in the 1 selected groups of 2"),
    (["--num-experts", "8", "--disable-bias-linear", "--tensor-model-parallel-size", "1",
      "--expert-tensor-parallel-size", "0"],
     "--expert-model-parallel-size=1: and --expert-tensor-parallel-size must be positive"),
    (["--num-experts", "8", "--moe-router-load-balancing-type", "quantile_balancing"],
     "--moe-router-load-balancing-type=quantile_balancing: pretrain_gpt.py runs aux_loss, seq_aux_loss, "
     "global_aux_loss, sinkhorn, none only"),
    (["--num-experts", "8", "--disable-bias-linear", "--moe-router-load-balancing-type", "sinkhorn",
      "--moe-aux-loss-coeff", "1e-2"],
     "--moe-aux-loss-coeff=0.01: must be 0 with --moe-router-load-balancing-type sinkhorn (megatron-core's rule)"),
    (["--num-experts", "8"], "--disable-bias-linear=False: is required with --num-experts"),
    (["--num-experts", "8", "--disable-bias-linear", "--moe-layer-freq", "[0,1]"],
     "--moe-layer-freq=[0, 1]: must give one entry per layer (4)"),
    (["--num-experts", "8", "--disable-bias-linear", "--fp16"], "--fp16=True: with --num-experts is not supported yet"),
    (["--fp8-format", "hybrid"], "--fp8-format=hybrid: GPU-only: FP8 and FP4 need Transformer Engine on a GPU"),
    (["--max-seqlen-per-dp-cp-rank", "8"], "--max-seqlen-per-dp-cp-rank=8: hybrid (dynamic) context parallelism"),
    (["--no-save-rng"], "--no-save-rng=True: a checkpoint option this trainer does not implement"),
    (["--disable-tp-comm-split-ag"], "--disable-tp-comm-split-ag=False: GPU-only: Transformer Engine's"),
    (["--optimizer", "sgd"], "--optimizer=sgd: pretrain_gpt.py runs adam, muon only"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style=WSD: pretrain_gpt.py runs constant, linear, cosine"),
    (["--batch-size", "4"], "--batch-size=4: removed from Megatron-LM"),
])
def test_refused_flags_fail_in_one_line_naming_the_flag(capsys, extra, line):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + extra)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith(f"pretrain_gpt.py: error: {line}"), err
    assert len(err.splitlines()) == 1, err


def test_refused_flags_at_megatron_lms_default_and_no_effect_flags_parse():
    switches = [o for a in megatron_parser()._actions for o in a.option_strings
                if a.nargs == 0 and any(o in group for group in flag_classes.NO_EFFECT.values())]
    args = parse_args(BASE + switches + ["--context-parallel-size", "1", "--optimizer", "adam",
                                         "--num-workers", "8", "--tiktoken-pattern", "v2"])
    assert args.context_parallel_size == 1 and len(switches) > 20


@pytest.mark.parametrize("extra, line", [
    (["--yaml-cfg", "/nonexistent.yaml"], "--yaml-cfg: Megatron-LM's experimental YAML configuration"),
    (["--heterogeneous-layers-config-encoded-json", '{"a":\n 1}'],
     '--heterogeneous-layers-config-encoded-json={"a": 1}'),
    (["--attention-backend", "local"], "(Megatron-LM's validate_args)"),
])
def test_inputs_megatron_lm_reads_while_parsing_still_fail_in_one_line(capsys, extra, line):
    with pytest.raises(SystemExit):
        parse_args(BASE + extra)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and line in err, err


def test_megatron_lm_defaults_that_our_rules_read_first(capsys, corpus):
    """--split's default (None) with --data-path, and --global-batch-size's (micro-batch x DP) with
    --train-samples, are Megatron-LM's; its banner lists settings, not the schedule object."""
    args = parse_args([a for a in BASE if a != "--mock-data"] + corpus[:2] + corpus[4:], world_size=1)
    assert args.split == "969, 30, 1"
    samples = BASE[:BASE.index("--global-batch-size")] + BASE[BASE.index("--lr"):]  # no batch, no length
    args = parse_args(samples + ["--train-samples", "3"], world_size=1)
    assert (args.global_batch_size, args.train_iters) == (1, 3)
    banner = capsys.readouterr().out
    assert "  schedule ...." not in banner and "  plan ...." not in banner and plan_of(args) is not None


def test_flags_with_no_effect_are_named_at_startup_in_one_line(capsys):
    """Given flags of the no-effect class are listed in one startup line, each with its value and the reason
    flag_classes gives; none given, no line."""
    parse_args(BASE + ["--ddp-bucket-size", "1000", "--log-progress"], world_size=1)
    said = [line for line in capsys.readouterr().out.splitlines() if "flags with no effect here" in line]
    assert len(said) == 1, f"lines naming flags with no effect: {said}"
    for flag in ("--ddp-bucket-size", "--log-progress"):
        reason = flag_classes.flag_class(flag)[1]
        assert flag in said[0] and reason in said[0], f"{flag} or its reason missing from {said[0]}"
    parse_args(BASE, world_size=1)
    assert "flags with no effect here" not in capsys.readouterr().out, "a line though no such flag was given"


def test_overlap_p2p_warmup_flush_alone_has_no_effect_and_builds_every_chunk():
    """--overlap-p2p-communication-warmup-flush without --overlap-p2p-communication's interleaved overlap: megatron-core
    refuses it beside batched p2p, which every chunk runs; here it has no effect, so every chunk builds."""
    from megatron.chimera.config.model_spec import ModelSpec
    from megatron.chimera.model import chunk

    args = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
                              "--overlap-p2p-communication-warmup-flush"], world_size=2)
    spec, plan = ModelSpec.from_args(args), plan_of(args)
    for stage, held in enumerate(plan.layout.stages):
        config = chunk.transformer_config(spec, held.layers, plan.layout.first_layer(stage), "cpu", False)
        assert config.batch_p2p_comm and not config.overlap_p2p_comm_warmup_flush, stage
