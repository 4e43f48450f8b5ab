"""Impossible layouts fail before any process group exists: one line naming the flag, exit code 2."""
import pytest

from megatron.chimera.config.arguments import parse_args
from megatron.chimera.config.run_plan import make_run_plan

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


@pytest.mark.parametrize("flags,world,needle", [
    (["--pipeline-model-parallel-size", "3", "--pipeline-schedule", "chimera", "--num-layers", "6"], 3,
     "--pipeline-model-parallel-size=3: Chimera needs an even number of stages"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera", "--global-batch-size", "6"], 4,
     "--global-batch-size=6: gives 6 micro-batches per pipeline replica"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera", "--chimera-pipelines", "3"], 4,
     "--chimera-pipelines=3: Chimera needs an even number of pipelines"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers=8: must be divisible by the 3 pipeline stages"),
    (["--pipeline-model-parallel-size", "2"], 3, "--pipeline-model-parallel-size=2: TP x PP = 2 must divide"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "megatron-interleaved",
      "--num-layers-per-virtual-pipeline-stage", "2"], 2, "megatron-core's interleaved schedule needs more than 2"),
    (["--overlap-param-gather"], 1, "--overlap-param-gather=True: needs --use-distributed-optimizer"),
    (["--lr-warmup-iters", "1"], 1, "--lr-warmup-iters=1: must be below the decay length, 1 (--lr-decay-iters"),
    (["--seq-length", "32"], 1, "--seq-length=32: must not exceed --max-position-embeddings (16)"),
    (["--fp16", "--bf16"], 1, "--fp16=True: give one of --fp16 and --bf16"),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], 1,
     "--min-loss-scale=8.0: must not exceed --initial-loss-scale (4)"),
    (["--recompute-granularity", "full"], 1, "--recompute-method=None: --recompute-granularity full needs"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", "--chimera-concat", "halving"], 2,
     "--chimera-concat=halving: applies to --pipeline-schedule chimera only"),
    (["--chimera-pipelines", "4"], 1, "--chimera-pipelines=4: applies to --pipeline-schedule chimera only"),
    (["--pipeline-schedule", "chimera", "--chimera-order", "fastest"], 1,
     "--chimera-order=fastest: must be one of paper, best"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--chimera-order", "best",
      "--chimera-concat", "doubling"], 2, "--chimera-concat=doubling: --chimera-order best builds its own order"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe", "--split-backward"], 2,
     "--split-backward=True: applies to --pipeline-schedule 1f1b or chimera only"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "dualpipe", "--global-batch-size", "4"], 4,
     "--global-batch-size=4: gives 4 micro-batches per pipeline replica (global batch / (micro-batch size x "
     "data-parallel size)); DualPipe needs an even number of at least 2 x --pipeline-model-parallel-size (8)"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "dualpipev", "--num-layers", "4"], 4,
     "--num-layers=4: must be divisible by the 8 pipeline stages"),
])
def test_impossible_configuration(capsys, flags, world, needle):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(MODEL + flags, world_size=world)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_split_backward_and_dualpipev_build_their_schedules():
    plan = make_run_plan(parse_args(MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
                                             "--split-backward"], world_size=2))
    assert plan.schedule.name == "chimera-direct-split" and plan.split_backward
    assert {a.op.value for a in plan.schedule.compute(0)} == {"F", "I", "W"}
    plan = make_run_plan(parse_args(MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"],
                                    world_size=2))
    assert (plan.model_stages, plan.schedule.placement) == (4, ((0, 1, 1, 0),))


def test_valid_chimera_configuration_builds_its_schedule():
    args = parse_args(MODEL + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera"], world_size=8)
    assert (args.data_parallel_size, args.num_microbatches) == (2, 4)
    plan = make_run_plan(args)
    assert plan.schedule.name == "chimera-direct" and plan.schedule.microbatches == 4
    assert len(plan.schedule.placement) == 2 and plan.schedule.meta["order"] == "paper"  # the defaults


def test_split_backward_with_transformer_engine_layers_is_refused_on_a_gpu(monkeypatch, capsys):
    """Where the layers would be Transformer Engine's (a GPU with TE installed, Megatron-LM's default
    --transformer-impl), --split-backward is refused in one line naming --transformer-impl."""
    import torch

    from megatron.chimera.model import chunk

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(chunk, "_transformer_engine_installed", lambda: True)
    split = MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--split-backward"]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(split, world_size=2)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("pretrain_gpt.py: error: --transformer-impl=transformer_engine: Transformer Engine's fused")
    assert chunk.uses_transformer_engine(parse_args(MODEL, world_size=1), "cuda")
    assert not chunk.uses_transformer_engine(parse_args(MODEL + ["--transformer-impl", "local"], world_size=1), "cuda")
