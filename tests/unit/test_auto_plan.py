"""--pipeline-schedule auto (config/auto_plan.py): the planner's flags replace it before the real parse, so an
auto run is the run of the flags it prints; a limit no plan fits is refused in one line."""
import argparse
import json
import re

import pytest
import torch

from megatron.chimera.arguments import parse_args
from megatron.chimera.plan import main as plan_main

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "128", "--make-vocab-size-divisible-by", "64",
         "--mock-data", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3"]
# the FLOP count at this machine's profile: the same plan at every call (a measurement's may differ between two)
FLOPS = ["--pipeline-profile", "cpu-this-machine"]
AUTO2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto"] + FLOPS
ROW = re.compile(r"^ ([*x ]) (.+?) {2,}\s*(\S+) +(\S+)% +(\S+)$", re.M)  # mark, plan, ms, bubble, peak GiB
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "none", "--disable-bias-linear"]


def planned(capsys, argv: list[str], world_size: int) -> tuple[dict, list[str], str]:
    """The namespace auto gives, the flags it printed and what it printed."""
    args = parse_args(argv, world_size=world_size)
    out = capsys.readouterr().out
    line = re.search(r"^ > pipeline plan: (.*) \(planned in \d+\.\d\d s\)$", out, re.M)
    assert line, f"no plan line in:\n{out}"
    return vars(args), line.group(1).split(), out


@pytest.mark.parametrize("extra,planning,pp,world", [
    ([], FLOPS, 2, 2), (MOE, FLOPS, 2, 4),
    # a vocabulary worth moving layers for: the balancer's layout wins, and is one of the printed flags
    (["--vocab-size", "100000"], ["--pipeline-profile", "h100-datasheet"], 4, 4),
], ids=["dense D=2", "moe D=2 EP=2", "large vocabulary D=4"])
def test_an_auto_run_is_the_run_of_the_flags_it_prints(capsys, extra, planning, pp, world):
    """Equal namespaces: the same run to the bit, whatever the plan (the trainer is a function of them)."""
    sizes = ["--pipeline-model-parallel-size", str(pp)]
    auto, flags, out = planned(capsys, MODEL + extra + sizes + ["--pipeline-schedule", "auto"] + planning, world)
    assert "--pipeline-schedule" in flags and "--micro-batch-size" in flags, flags  # the batch is the planner's too
    assert ("--pipeline-model-parallel-layout" in flags) == (planning != FLOPS), f"balanced layout expected: {flags}"
    again = vars(parse_args(MODEL + extra + sizes + flags, world_size=world))
    assert auto.pop("pipeline_plan") == flags, "the plan kept for the checkpoint is not the printed one"
    differing = {k: (auto.get(k), again.get(k)) for k in auto.keys() | again.keys() if auto.get(k) != again.get(k)}
    assert differing == {}, f"auto and its printed flags {flags} differ in {differing}"
    rows = ROW.findall(out)
    assert len(rows) == 5 and rows[0][0] == "*", f"the table's rows, best first, the pick marked:\n{out}"


def test_a_limit_the_pick_exceeds_picks_another_plan_under_it(capsys):
    """The unconstrained pick's predicted peak less 1% as the limit: the pick changes, to a plan under it."""
    _, _, out = planned(capsys, MODEL + AUTO2, 2)
    first = next(r for r in ROW.findall(out) if r[0] == "*")
    limit = 0.99 * float(first[4])
    _, flags, out = planned(capsys, MODEL + AUTO2 + ["--pipeline-memory-limit-gb", repr(limit)], 2)
    rows = ROW.findall(out)
    pick = next(r for r in rows if r[0] == "*")
    assert pick[1] != first[1] and float(pick[4]) <= limit * 1.001, f"limit {limit} GiB, picked {pick}:\n{out}"
    assert all(r[0] == "x" for r in rows[:rows.index(pick)]), f"a faster plan under the limit was passed over:\n{out}"


def test_no_plan_within_the_memory_limit_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(MODEL + AUTO2 + ["--pipeline-memory-limit-gb", "1e-6"], world_size=2)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1, err
    assert re.fullmatch(r"pretrain_gpt.py: error: --pipeline-memory-limit-gb=1e-06: no pipeline plan fits in 1e-06 GiB "
                        r"per worker: the smallest, .*, needs [0-9.e-]+ GiB", err[0]), err[0]


@pytest.mark.parametrize("extra,needle", [
    (AUTO2 + ["--chimera-concat", "doubling"], "--chimera-concat=True: is chosen by --pipeline-schedule auto"),
    (AUTO2 + ["--hanayo-waves", "2"], "--hanayo-waves=True: is chosen by --pipeline-schedule auto"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--pipeline-memory-limit-gb", "8"],
     "--pipeline-memory-limit-gb=True: applies with --pipeline-schedule auto only"),
], ids=["a schedule option", "a successor's option", "a planning flag without auto"])
def test_auto_refuses_what_it_chooses_and_its_flags_need_it(capsys, extra, needle):
    with pytest.raises(SystemExit) as exit:
        parse_args(MODEL + extra, world_size=2)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and needle in err[0], err


def saved_checkpoint(root, plan: list[str] | None) -> str:
    """A torch_dist checkpoint folder at iteration 1 of this model, its args holding ``plan`` as an auto run
    saves it (the common state only: what parsing reads of a checkpoint)."""
    folder = root / "iter_0000001"
    folder.mkdir(parents=True)
    saved = vars(parse_args(MODEL + ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"], world_size=2))
    torch.save({"iteration": 1, "args": argparse.Namespace(**saved, **({"pipeline_plan": plan} if plan else {}))},
               folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return str(root)


KEPT = ["--pipeline-schedule", "1f1b", "--micro-batch-size", "2"]  # not what auto picks for MODEL at D=2


@pytest.mark.parametrize("plan,extra,said,reason", [
    (KEPT, [], r"kept from the checkpoint at iteration 1 in \S+; --pipeline-replan plans again", None),
    (KEPT, ["--pipeline-replan"], r"planned in \S+ s",
     "planned again (--pipeline-replan), not kept from the checkpoint"),
    (["--pipeline-schedule", "1f1b", "--micro-batch-size", "3"], [], r"planned in \S+ s",
     "the plan of the checkpoint at iteration 1 is refused now (--global-batch-size=8: must be a multiple"),
    (None, [], r"planned in \S+ s", None),
], ids=["kept", "--pipeline-replan", "refused now", "a checkpoint without a plan"])
def test_a_resumed_auto_run_keeps_the_checkpoints_plan_unless_told_or_refused(capsys, tmp_path, plan, extra, said,
                                                                             reason):
    load = saved_checkpoint(tmp_path / "ckpt", plan)
    capsys.readouterr()
    args = parse_args(MODEL + AUTO2 + ["--load", load, "--no-load-optim", "--no-load-rng"] + extra, world_size=2)
    out = capsys.readouterr().out
    line = re.search(r"^ > pipeline plan: (.*) \((.*)\)$", out, re.M)
    assert line and re.fullmatch(said, line.group(2)), f"plan line {line and line.group(0)!r}, expected {said!r}"
    assert args.pipeline_plan == line.group(1).split(), f"saved plan {args.pipeline_plan}, printed {line.group(1)}"
    if plan == KEPT and not reason:
        assert (args.pipeline_schedule, args.micro_batch_size) == ("1f1b", 2), "the kept plan was not the run's"
    else:
        assert args.pipeline_plan != plan, f"the checkpoint's plan {plan} was kept"
    assert reason is None or f"   {reason}" in out, f"no line saying {reason!r}:\n{out}"


def test_the_offline_plan_prints_the_table_and_flags_the_run_would(capsys, tmp_path):
    """python -m megatron.chimera.plan: a launch script's flags in a file (continuations, a comment), more after
    --; the same ranked table and the same pick as the run's own startup."""
    script = tmp_path / "model.flags"
    script.write_text("# the model, as a launch script has it\n" + " \\\n".join(" ".join(MODEL[i:i + 2])
                                                                               for i in range(0, len(MODEL), 2)))
    picked = plan_main(["--world-size", "2", "--flags-file", str(script), "--", "--pipeline-model-parallel-size", "2",
                        *FLOPS])
    offline = capsys.readouterr().out
    run, flags, out = planned(capsys, MODEL + AUTO2, 2)
    assert picked == flags == run["pipeline_plan"], f"offline {picked}, the run {flags}"
    assert ROW.findall(offline) == ROW.findall(out) and len(ROW.findall(offline)) == 5, f"tables differ:\n{offline}"
    assert "------------------------ arguments" not in offline, "the offline plan printed Megatron-LM's arguments"


def test_without_pipelining_auto_plans_over_the_data_parallel_ranks(capsys):
    """PP=1 over DP=2: interleaving needs PP > 1 (Megatron-LM's validate_args refuses it), so it is no candidate,
    and a candidate Megatron-LM refuses would be passed over as one of ours is, never the run's end."""
    args, flags, out = planned(capsys, MODEL + ["--pipeline-schedule", "auto"] + FLOPS, 2)
    plans = [row[1] for row in ROW.findall(out)]
    assert args["pipeline_model_parallel_size"] == 1 and plans, f"picked {flags}:\n{out}"
    assert not [p for p in plans if "interleaved" in p or "balanced" in p], f"one stage, yet planned as more:\n{out}"


def test_without_a_profile_auto_plans_from_stage_costs_measured_at_startup_and_saves_them(capsys, tmp_path):
    """No --pipeline-profile: the parts are timed on this device (stage_costs.py) and the table says so; the
    numbers land in --save, and a run given that file plans from them, to the same plan (the file prices every
    stage as the measurement did). An MoE model with MTP: every kind of part is measured."""
    model = MODEL + MOE + ["--mtp-num-layers", "1", "--position-embedding-type", "rope",
                           "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto"]
    measured, flags, out = planned(capsys, model + ["--save", str(tmp_path), "--save-interval", "1"], 4)
    assert "costs: stage costs measured at startup on 1 rank(s)" in out, f"not planned from a measurement:\n{out}"
    parts = re.search(r"stage parts \(ms forward/backward, micro-batch size \d+, one device\): (.*)", out)
    assert parts and [p.split()[0] for p in parts.group(1).split(", ")] == ["layer", "output", "moe_layer", "mtp"], out
    saved = tmp_path / "pipeline_profile.json"
    _, again, out = planned(capsys, model + ["--pipeline-profile", str(saved)], 4)
    assert f"costs: stage costs from {saved} (measured on 1 rank(s)" in out, f"not planned from the file:\n{out}"
    assert again == flags, f"the measured run picked {flags}, the run given its measurement {again}"


def test_the_printed_stage_costs_are_the_ones_the_trainers_schedule_is_built_at(capsys):
    """The plan's --pipeline-stage-costs reach the request the run plan generates its schedule from (the schedule
    library builds the cost-dependent orders at them: tests/schedules/test_schedules.py)."""
    from megatron.chimera.config.schedule_request import schedule_request

    args, flags, _ = planned(capsys, MODEL + AUTO2, 2)
    given = flags[flags.index("--pipeline-stage-costs") + 1]
    assert schedule_request(argparse.Namespace(**args)).stage_costs == given, f"{given} did not reach the request"
