"""Communication as data: the lowering, and the checker that replays it under NCCL's rules.

The checker must be able to fail: the classic deadlock of NCCL_MODEL.md, hand-written, and the
executor's former design (one group per pipeline, receives at need) are rejected under nccl and
accepted under gloo. Every generated schedule of the grid, lowered, passes under all three modes.
"""
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from chimera_schedules import InvalidSchedule, build, simulate
from chimera_schedules.analysis.nccl_model import MODES, check, shared_groups
from chimera_schedules.ir.actions import Op
from chimera_schedules.ir.costs import CostModel
from chimera_schedules.ir.dataflow import forward_only
from chimera_schedules.ir.schedule import Schedule
from chimera_schedules.passes.lowering import RECV_BUFFERS, lower
from chimera_schedules.runtime.executor import make_forward_backward
from chimera_schedules.runtime.messages import Transport
from chimera_schedules.tools.cli import main
from megatron.chimera.distributed.group_guard import UnwarmedGroup, guard_communicators
from megatron.chimera.distributed.warmup import WarmedUp, megatron_group_names
from megatron.chimera.testing.legacy_lowering import legacy_lower

# The classic deadlock (NCCL_MODEL.md): 1F1B on two workers, one group carrying activations down and
# gradients up; in the steady state each worker posts a send before the receive its peer sends first.
CLASSIC = {
    "stages": 2, "microbatches": 2,
    "workers": [
        [{"op": "F", "mb": 0, "pipeline": 0, "stage": 0},
         {"op": "SEND", "peer": 1, "group": "pipe", "kind": "act", "mb": 0, "pipeline": 0, "stage": 1},
         {"op": "F", "mb": 1, "pipeline": 0, "stage": 0},
         {"op": "SEND", "peer": 1, "group": "pipe", "kind": "act", "mb": 1, "pipeline": 0, "stage": 1},
         {"op": "RECV", "peer": 1, "group": "pipe", "kind": "grad", "mb": 0, "pipeline": 0, "stage": 0},
         {"op": "B", "mb": 0, "pipeline": 0, "stage": 0},
         {"op": "RECV", "peer": 1, "group": "pipe", "kind": "grad", "mb": 1, "pipeline": 0, "stage": 0},
         {"op": "B", "mb": 1, "pipeline": 0, "stage": 0}],
        [{"op": "RECV", "peer": 0, "group": "pipe", "kind": "act", "mb": 0, "pipeline": 0, "stage": 1},
         {"op": "F", "mb": 0, "pipeline": 0, "stage": 1},
         {"op": "B", "mb": 0, "pipeline": 0, "stage": 1},
         {"op": "SEND", "peer": 0, "group": "pipe", "kind": "grad", "mb": 0, "pipeline": 0, "stage": 0},
         {"op": "RECV", "peer": 0, "group": "pipe", "kind": "act", "mb": 1, "pipeline": 0, "stage": 1},
         {"op": "F", "mb": 1, "pipeline": 0, "stage": 1},
         {"op": "B", "mb": 1, "pipeline": 0, "stage": 1},
         {"op": "SEND", "peer": 0, "group": "pipe", "kind": "grad", "mb": 1, "pipeline": 0, "stage": 0}],
    ],
}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, obj) -> str:
    path = tmp_path / "lowered.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_classic_deadlock_is_rejected_under_nccl_with_its_cycle(capsys, tmp_path):
    path = write(tmp_path, CLASSIC)
    code, _, err = run(capsys, "validate", "--comm", "nccl", path)
    assert code == 1
    assert "wait-for cycle" in err and "worker 0's sA1p0s1>1@pipe on group pipe" in err
    assert "worker 1's sG0p0s0>0@pipe on group pipe" in err
    assert run(capsys, "validate", "--comm", "nccl-single-queue", path)[0] == 1


def test_classic_deadlock_is_accepted_under_gloo(capsys, tmp_path):
    code, out, _ = run(capsys, "validate", "--comm", "gloo", write(tmp_path, CLASSIC))
    assert code == 0 and "proven" in out


def test_megatron_style_batches_fix_the_classic_deadlock(capsys, tmp_path):
    """Megatron-core's cure: each send posted in one batch with the receive it needs next."""
    fixed = json.loads(json.dumps(CLASSIC))
    w0, w1 = fixed["workers"]
    w0[3]["batch"] = w0[4]["batch"] = 7  # send(act 1) + recv(grad 0)
    w1[3]["batch"] = w1[4]["batch"] = 7  # send(grad 0) + recv(act 1)
    code, out, _ = run(capsys, "validate", "--comm", "nccl", write(tmp_path, fixed))
    assert code == 0, out


def test_messages_matched_out_of_order_are_wrong_data_not_just_slow(capsys, tmp_path):
    swapped = json.loads(json.dumps(CLASSIC))
    w1 = swapped["workers"][1]
    w1.insert(0, w1.pop(4))  # receives act 1 before act 0: gloo, matching by order, would hand it act 0
    code, _, err = run(capsys, "validate", "--comm", "gloo", write(tmp_path, swapped))
    assert code == 1 and "mismatched messages on group pipe" in err


def test_hand_written_files_are_checked_by_the_rules(capsys, tmp_path):
    late = json.loads(json.dumps(CLASSIC))
    w1 = late["workers"][1]
    w1[0], w1[1] = w1[1], w1[0]  # receive after the forward that needs it
    code, _, err = run(capsys, "validate", "--comm", "gloo", write(tmp_path, late))
    assert code == 1 and "F0p0s1" in err and "no RECV of its input" in err
    unsent = json.loads(json.dumps(CLASSIC))
    del unsent["workers"][0][1]
    code, _, err = run(capsys, "validate", "--comm", "gloo", write(tmp_path, unsent))
    assert code == 1 and "never sent" in err
    code, _, err = run(capsys, "validate", write(tmp_path, late))  # without --comm: the rules still apply
    assert code == 1 and "no RECV of its input" in err


@pytest.mark.parametrize("name, d, n", [("1f1b", 2, 4), ("chimera", 4, 8)])
def test_former_one_group_per_pipeline_design_deadlocks_and_the_lowering_does_not(name, d, n):
    schedule = build(name, d, n)
    check(legacy_lower(schedule), "gloo")
    with pytest.raises(InvalidSchedule, match=r"deadlock \(nccl\): wait-for cycle: worker \d's s[AG]\d+p\ds\d>\d@p\d"):
        check(legacy_lower(schedule), "nccl")
    for mode in MODES:
        check(lower(schedule), mode)


def grid():
    out = []
    for d in (2, 4, 8):  # what the README claims: D up to 8, N up to 4D, split and DualPipe included
        for n in (d, 2 * d, 4 * d):
            out += [("gpipe", d, n, {}), ("1f1b", d, n, {}), ("interleaved", d, n, {"virtual_stages": 2}),
                    ("chimera", d, n, {}), ("chimera", d, n, {"concat": "halving"})]
            if n % (2 * d) == 0:
                out.append(("chimera", d, n, {"concat": "doubling"}))
            if d % 4 == 0:
                out.append(("chimera", d, n, {"pipelines": 4}))
            if n <= 2 * d and d <= 4:  # at D=8, N=16 the search alone takes 17 s (test_schedules runs it)
                out.append(("chimera", d, n, {"order": "best"}))
            out += [("1f1b", d, n, {"split_backward": True}), ("chimera", d, n, {"split_backward": True})]
            out += [("dualpipe", d, n, {}), ("dualpipev", d, n, {})] if n >= 2 * d else []
    return out


def test_every_generated_schedule_lowered_passes_every_mode():
    for name, d, n, extra in grid():
        schedule = build(name, d, n, **extra)
        lowered = lower(schedule)
        for mode in MODES:
            check(lowered, mode)
            check(forward_only(lowered), mode)
        # no communication cost: posting ahead loses nothing against the ideal replay
        assert simulate(lowered).makespan == pytest.approx(simulate(schedule).makespan), (name, d, n, extra)


def test_lowering_names_channels_per_direction_and_bounds_posted_receives():
    lowered = lower(build("chimera", 4, 8))
    groups = {a.group for w in lowered.workers for a in w if a.op in (Op.SEND, Op.RECV)}
    assert groups == {"down", "up"}
    wrong = [(w, a) for w, actions in enumerate(lowered.workers) for a in actions
             if a.op in (Op.SEND, Op.RECV) and a.group != ("down" if (a.peer > w) == (a.op is Op.SEND) else "up")]
    assert wrong == [], f"(worker, message) on the other direction's channel: {wrong}"
    wrong = [a for w in lowered.workers for a in w if a.op is Op.ALLREDUCE and a.group != f"stage{a.stage}"]
    assert wrong == [], f"all-reduces outside their stage's group: {wrong}"
    lowered = lower(build("gpipe", 4, 16))  # every receive could be posted at once without the bound
    for actions in lowered.workers:
        posted = set()
        for a in actions:
            if a.op is Op.RECV:
                posted.add(a.message)
            elif a.op in (Op.FORWARD, Op.BACKWARD):
                posted.discard((("act" if a.op is Op.FORWARD else "grad"), a.pipeline, a.stage, a.mb))
            assert len(posted) <= RECV_BUFFERS + 1  # the bound, plus the one posted just before its consumer


def test_posting_ahead_overlaps_transfers_the_former_design_serialises():
    costs = CostModel(1.0, 2.0, p2p_latency=0.5)
    schedule = build("1f1b", 4, 8)
    ahead, at_need = simulate(lower(schedule), costs, "gloo"), simulate(legacy_lower(schedule), costs, "gloo")
    assert ahead.makespan < at_need.makespan
    assert len(ahead.transfers) == 2 * 2 * 3 * 8  # every message, at both ends


def reversed_reductions(lowered: Schedule, rename: dict | None = None) -> Schedule:
    """Chimera D=2's lowered lists with worker 1's reductions posted in reverse order, their groups
    renamed by ``rename``."""
    renamed = lambda a: dataclasses.replace(a, group=rename.get(a.group, a.group)) if rename else a  # noqa: E731
    workers = [[renamed(a) for a in actions] for actions in lowered.workers]
    reductions = [a for a in workers[1] if a.op is Op.ALLREDUCE]
    assert len(reductions) == 2 and len({a.group for a in reductions}) == 2
    workers[1] = [a for a in workers[1] if a.op is not Op.ALLREDUCE] + reductions[::-1]
    return Schedule(name="swapped", depth=2, microbatches=2, placement=lowered.placement,
                    workers=tuple(map(tuple, workers)))


def test_collectives_posted_in_different_orders_deadlock_only_on_a_single_queue():
    """Two groups of their own with the same two members; one worker posts them reversed."""
    swapped = reversed_reductions(lower(build("chimera", 2, 2)), {"stage0": "g0", "stage1": "g1"})
    check(swapped, "nccl")  # independent streams: any order completes
    with pytest.raises(InvalidSchedule, match="single hardware queue"):
        check(swapped, "nccl-single-queue")


def test_stage_groups_of_one_rank_set_are_one_communicator_whose_order_every_member_keeps():
    """Chimera: stage s and stage D-1-s have the same holders, so the trainer gives them one process
    group: reversed on one worker, each reduction would meet the other stage's, in every mode."""
    assert shared_groups(lower(build("chimera", 4, 4))) == {
        "stage0": "stage0/stage3", "stage3": "stage0/stage3", "stage1": "stage1/stage2", "stage2": "stage1/stage2"}
    assert set(shared_groups(lower(build("1f1b", 4, 4))).values()) == {"stage0", "stage1", "stage2", "stage3"}
    for mode in MODES:
        with pytest.raises(InvalidSchedule, match=r"collectives out of order on group stage0/stage1: .* wrong data"):
            check(reversed_reductions(lower(build("chimera", 2, 2))), mode)


def test_export_lowered_round_trips_through_validate(capsys, tmp_path):
    path = tmp_path / "chimera.json"
    assert run(capsys, "export", "--lowered", "-D", "4", "-N", "8", "--out", str(path))[0] == 0
    obj = json.loads(path.read_text())
    sends = [a for w in obj["workers"] for a in w if a["op"] == "SEND"]
    assert sends and set(sends[0]) == {"op", "peer", "group", "kind", "mb", "pipeline", "stage"}
    reductions = [a for w in obj["workers"] for a in w if a["op"] == "ALLREDUCE"]
    assert reductions and all(set(a) == {"op", "group", "pipeline", "stage"} for a in reductions)
    code, out, _ = run(capsys, "validate", "--comm", "nccl", str(path))
    assert code == 0 and "proven" in out
    assert Schedule.from_json(obj) == lower(build("chimera", 4, 8))


def test_validate_comm_with_options_lowers_as_the_trainer_does(capsys):
    code, out, _ = run(capsys, "validate", "--comm", "nccl-single-queue", "--schedule", "1f1b", "-D", "2", "-N", "4")
    assert code == 0 and "proven" in out


def test_collectives_that_use_the_compute_core_are_not_hidden_behind_compute():
    """gloo on one core per rank: an all-reduce overlapping a backward delays it."""
    schedule = lower(build("chimera", 2, 2))
    overlapped = simulate(schedule, CostModel(1.0, 2.0, allreduce_latency=1.0), "gloo")
    on_core = simulate(schedule, CostModel(1.0, 2.0, allreduce_latency=1.0, collectives_use_compute=True), "gloo")
    assert on_core.makespan > overlapped.makespan
    assert on_core.busy == overlapped.busy


def test_the_executor_refuses_megatron_core_options_it_does_not_implement():
    """Set, they would be silently ignored; refused before anything runs."""
    transport = Transport(0, [0, 1], {}, torch.device("cpu"), torch.float32, p2p=None)
    forward_backward = make_forward_backward(lower(build("1f1b", 2, 2)), transport, grad_sync=None)
    common = dict(forward_step_func=None, data_iterator=None, model=None, num_microbatches=2, seq_length=8,
                  micro_batch_size=1)
    for option, value in (("collect_non_loss_data", True), ("force_all_reduce", True), ("decoder_seq_length", 4),
                          ("first_val_step", True), ("adjust_tensor_shapes_fn", print)):
        with pytest.raises(NotImplementedError, match=option):
            forward_backward(**common, **{option: value})


def test_a_group_the_warm_up_did_not_walk_fails_at_once_with_one_line_naming_it(one_process_group):
    """The guard the trainer installs under NCCL and --emulate-nccl, over a warm-up that walked only the
    world: megatron-core's expert-parallel group, used on purpose, is refused before it communicates;
    so is a send to a pair never walked. Uninstalled, the group works again."""
    world, experts = dist.group.WORLD, parallel_state.get_expert_model_parallel_group()
    names = {**megatron_group_names(), world: "world group [0]"}
    guard = guard_communicators(WarmedUp({world: names[world]}, frozenset(), 1, names))
    try:
        dist.all_reduce(torch.zeros(1))
        with pytest.raises(UnwarmedGroup) as refused:
            dist.all_reduce(torch.zeros(1), group=experts)
        with pytest.raises(UnwarmedGroup, match=r"^send with rank 0 on world group \[0\]: a pair not warmed up"):
            guard.check(world, "send", 0)
    finally:
        guard.uninstall()
    assert str(refused.value) == ("allreduce on megatron-core's expert-model-parallel group [0]: not warmed up before "
                                  "iteration 1, so NCCL would create its communicator now, while other kernels run "
                                  "(NCCL_MODEL.md rule 10)")
    dist.all_reduce(torch.zeros(1), group=experts)
