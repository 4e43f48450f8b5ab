"""The expert and tied-embedding reductions in the lowered lists (what the trainer asks for under
--overlap-grad-reduce): where lowering posts them, and the NCCL checker's proof of their order, which
must be able to fail."""
import dataclasses

import pytest

from chimera_schedules import InvalidSchedule, build, build_spec, variant
from chimera_schedules.analysis.nccl_model import MODES, check, shared_groups
from chimera_schedules.ir.actions import Op, parts
from chimera_schedules.ir.dataflow import compute_part, forward_only
from chimera_schedules.ir.schedule import Schedule
from chimera_schedules.passes.lowering import lower
from chimera_schedules.runtime import faults

GRID = [("chimera", 2, 4, {}), ("chimera", 4, 8, {}), ("chimera", 4, 8, {"split_backward": True}),
        ("chimera", 4, 8, {"pipelines": 4}), ("1f1b", 4, 8, {}), ("interleaved", 2, 4, {"virtual_stages": 2}),
        ("dualpipe", 4, 8, {}), ("dualpipev", 2, 4, {}), ("gpipe", 2, 2, {})]


def wider(schedule: Schedule, embedding_stages=None) -> Schedule:
    """Lowered with every stage's expert reduction and a tied embedding on the first and last stages."""
    last = schedule.stages_per_pipeline - 1
    return lower(schedule, experts=True, embedding_stages=(0, last) if embedding_stages is None else embedding_stages)


def reductions(lowered: Schedule, w: int) -> list[str]:
    return [str(a) for a in lowered.workers[w] if a.op is Op.ALLREDUCE]


@pytest.mark.parametrize("name, d, n, extra", GRID)
def test_every_holder_posts_them_after_its_last_backward_and_the_lists_are_proven(name, d, n, extra):
    """Every worker posts each held stage's expert reduction right after the stage's own, and one
    embedding reduction where it holds the first or last stage, after the backwards of every copy it
    holds of those; the lists (and evaluation's) complete in every mode."""
    schedule = build(name, d, n, **extra)
    lowered = wider(schedule)
    last = schedule.stages_per_pipeline - 1
    for w, actions in enumerate(lowered.workers):
        held = {stage for _, stage in schedule.held(w)}
        posted = [a for a in actions if a.op is Op.ALLREDUCE]
        for stage in held:
            at = max(i for i, a in enumerate(posted) if a.group == f"stage{stage}")
            assert posted[at + 1].group == f"experts{stage}", (name, w, reductions(lowered, w))
        tied = [i for i, a in enumerate(actions) if a.op is Op.ALLREDUCE and a.group == "embedding"]
        assert len(tied) == bool(held & {0, last}), (name, w, reductions(lowered, w))
        backwards = [i for i, a in enumerate(actions) if a.op not in (Op.SEND, Op.RECV, Op.ALLREDUCE)
                     for p in parts(a) if p.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT) and p.stage in (0, last)]
        assert not tied or tied[0] > max(backwards), (name, w)
    assert compute_part(lowered) == compute_part(lower(schedule))  # the compute lists are the same
    for mode in MODES:
        check(lowered, mode)
        check(forward_only(lowered), mode)


@pytest.mark.parametrize("name", ["chimera direct overlap", "dualpipev overlap"])
def test_lists_with_overlapped_and_halved_actions_are_proven(name):
    schedule = build_spec(variant(name, 4 if name.startswith("chimera") else 2, 8))
    check(wider(schedule), "nccl-single-queue")


def test_without_the_options_the_lists_are_unchanged():
    schedule = build("chimera", 4, 8)
    assert lower(schedule, embedding_stages=(0,)) == lower(schedule)  # one copy of the embedding: nothing to sum
    assert {a.group for w in lower(schedule).workers for a in w if a.op is Op.ALLREDUCE} == {
        f"stage{s}" for s in range(4)}


def test_expert_and_embedding_groups_run_on_the_communicator_of_their_workers():
    """The embedding group's ranks are those of Chimera's stage 0 and 3 (one process group); a stage's
    expert group is modelled on its stage's communicator (the stricter model). Under 1F1B the embedding
    group has workers no stage group has."""
    assert shared_groups(wider(build("chimera", 4, 4))) == {
        **dict.fromkeys(["stage0", "experts0", "stage3", "experts3", "embedding"],
                        "stage0/experts0/stage3/experts3/embedding"),
        **dict.fromkeys(["stage1", "experts1", "stage2", "experts2"], "stage1/experts1/stage2/experts2")}
    assert shared_groups(wider(build("1f1b", 4, 4)))["embedding"] == "embedding"
    # a stage of MTP layers holds a copy too: three stages, one group
    assert shared_groups(wider(build("1f1b", 4, 4), (0, 2, 3)))["embedding"] == "embedding"


def swapped(lowered: Schedule, w: int, first: str, second: str) -> Schedule:
    """``lowered`` with worker ``w``'s all-reduces on groups ``first`` and ``second`` trading places."""
    actions = list(lowered.workers[w])
    i, j = (next(k for k, a in enumerate(actions) if a.op is Op.ALLREDUCE and a.group == g) for g in (first, second))
    actions[i], actions[j] = actions[j], actions[i]
    return dataclasses.replace(lowered, workers=lowered.workers[:w] + (tuple(actions),) + lowered.workers[w + 1:])


def without(lowered: Schedule, w: int, group: str) -> Schedule:
    actions = tuple(a for a in lowered.workers[w] if not (a.op is Op.ALLREDUCE and a.group == group))
    return dataclasses.replace(lowered, workers=lowered.workers[:w] + (actions,) + lowered.workers[w + 1:])


def test_the_checker_rejects_an_order_the_members_do_not_share():
    """Chimera D=4: worker 0 posts its embedding reduction before stage 3's expert reduction, worker 3
    (the other member) after it: on their shared communicator each would meet the other's, in every
    mode."""
    lowered = wider(build("chimera", 4, 4))
    early = swapped(lowered, 0, "experts0", "embedding")
    for mode in MODES:
        with pytest.raises(InvalidSchedule, match="collectives out of order on group stage0/experts0/.*wrong data"):
            check(early, mode)


def test_the_checker_rejects_a_member_left_out_or_a_reduction_posted_too_early():
    lowered = wider(build("chimera", 4, 8))
    with pytest.raises(InvalidSchedule, match="no reduction posted on experts1"):
        check(without(lowered, 1, "experts1"), "nccl")
    with pytest.raises(InvalidSchedule, match="no reduction posted on embedding"):
        check(without(lowered, 3, "embedding"), "nccl")
    actions = [a for a in lowered.workers[0] if not (a.op is Op.ALLREDUCE and a.group == "embedding")]
    tied = next(a for a in lowered.workers[0] if a.op is Op.ALLREDUCE and a.group == "embedding")
    early = dataclasses.replace(lowered, workers=((tied, *actions),) + lowered.workers[1:])
    with pytest.raises(InvalidSchedule, match="before the last backward of a copy it sums"):
        check(early, "nccl")
    stranger = dataclasses.replace(lowered, workers=lowered.workers[:1] + ((*lowered.workers[1], tied),)
                                   + lowered.workers[2:])  # worker 1 holds stages 1 and 2 only
    with pytest.raises(InvalidSchedule, match="where no copy of what group embedding sums is held"):
        check(stranger, "nccl")


def test_lowered_lists_with_them_round_trip_through_json():
    lowered = wider(build("dualpipev", 2, 4))
    assert Schedule.loads(lowered.dumps()) == lowered
    assert Schedule.loads(lowered.dumps()).meta["embedding_stages"] == [0, 3]
    check(Schedule.loads(lowered.dumps()), "nccl-single-queue")


def test_a_failed_start_names_what_it_reduced(monkeypatch):
    """A fault raised by starting one of them names the experts' or the embedding's reduction."""
    monkeypatch.setattr(faults.dist, "get_rank", lambda: 0)
    lowered = wider(build("chimera", 2, 4))
    headlines = [faults.action_fault(a, ValueError("boom"), 0, [0, 1]).headline for a in lowered.workers[0]
                 if a.op is Op.ALLREDUCE and a.group in ("experts1", "embedding")]
    assert headlines == ["rank 0 (worker 0): the expert gradient all-reduce of pipeline 1, stage 1 on group experts1 "
                         "(ARp1s1@experts1) raised ValueError: boom",
                         "rank 0 (worker 0): the word embedding's gradient all-reduce on group embedding "
                         "(ARp0s0@embedding) raised ValueError: boom"], headlines
