"""Hand-broken schedules are rejected with the right reason, worker and action."""
import dataclasses

import pytest

from chimera_schedules import InvalidSchedule, Schedule, build, validate
from chimera_schedules.ir.actions import B, F


def edited(schedule: Schedule, worker: int, actions) -> Schedule:
    workers = list(schedule.workers)
    workers[worker] = tuple(actions)
    return dataclasses.replace(schedule, workers=tuple(workers))


def rejects(schedule: Schedule, reason: str) -> InvalidSchedule:
    with pytest.raises(InvalidSchedule, match=reason) as info:
        validate(schedule)
    return info.value


@pytest.fixture
def chimera4():
    return build("chimera", 4, 4)


def test_dropped_action(chimera4):
    actions = list(chimera4.workers[2])
    actions.remove(B(1, 0, 2))
    err = rejects(edited(chimera4, 2, actions), "dropped action: no backward B1p0s2")
    assert err.worker == 2


def test_duplicated_action(chimera4):
    actions = list(chimera4.workers[1]) + [F(0, 0, 1)]
    err = rejects(edited(chimera4, 1, actions), "duplicated action")
    assert (err.worker, err.action) == (1, F(0, 0, 1))


def test_backward_before_its_forward(chimera4):
    actions = list(chimera4.workers[3])
    actions.remove(B(0, 0, 3))
    actions.insert(0, B(0, 0, 3))
    err = rejects(edited(chimera4, 3, actions), "backward before its forward")
    assert (err.worker, err.action) == (3, B(0, 0, 3))


def test_action_on_the_wrong_worker(chimera4):
    moved = F(0, 0, 1)  # down stage 1 lives on worker 1
    w0 = list(chimera4.workers[0]) + [moved]
    w1 = [a for a in chimera4.workers[1] if a != moved]
    err = rejects(edited(edited(chimera4, 1, w1), 0, w0), "wrong worker: pipeline 0 stage 1 is held by worker 1")
    assert (err.worker, err.action) == (0, moved)


def test_cross_worker_cycle():
    s = build("1f1b", 2, 2)
    # worker 0 waits for micro-batch 1's gradient before sending micro-batch 1 forward
    w0 = [F(0, 0, 0), B(0, 0, 0), B(1, 0, 0), F(1, 0, 0)]
    err = rejects(edited(s, 0, w0 + [a for a in s.workers[0] if a.op.value == "R"]), "backward before its forward")
    assert err.worker == 0
    # a real cycle: each worker waits for the other's later work
    w0 = [F(0, 0, 0), B(0, 0, 0), F(1, 0, 0), B(1, 0, 0)]
    w1 = [F(1, 0, 1), B(1, 0, 1), F(0, 0, 1), B(0, 0, 1)]
    err = rejects(edited(edited(s, 0, w0), 1, w1), "deadlock: cross-worker cycle")
    assert "worker 0 at B0p0s0 waits for input gradient of micro-batch 0" in str(err)
    assert "worker 1 at F1p0s1 waits for forward of micro-batch 1" in str(err)


def test_reduction_before_last_backward(chimera4):
    actions = list(chimera4.workers[0])
    r = next(a for a in actions if a.op.value == "R" and a.pipeline == 0)
    actions.remove(r)
    actions.insert(0, r)
    rejects(edited(chimera4, 0, actions), "gradient reduction before the last backward")


def test_microbatch_in_two_pipelines(chimera4):
    actions = [a if a != F(1, 0, 0) else F(1, 1, 3) for a in chimera4.workers[0]]
    err = rejects(edited(chimera4, 0, actions), "micro-batch 1 already runs in pipeline 1")
    assert err.action == B(1, 0, 0)


def test_out_of_range_and_shape(chimera4):
    rejects(edited(chimera4, 0, list(chimera4.workers[0]) + [F(9, 0, 0)]), "micro-batch 9 out of range")
    rejects(dataclasses.replace(chimera4, workers=chimera4.workers[:3]), "3 worker lists for 4 stages")


def test_json_without_placement_is_inferred_and_valid():
    text = '{"stages": 2, "microbatches": 1, "workers": [' \
           '[{"op": "F", "mb": 0, "pipeline": 0, "stage": 0}, {"op": "B", "mb": 0, "pipeline": 0, "stage": 0}],' \
           '[{"op": "F", "mb": 0, "pipeline": 0, "stage": 1}, {"op": "B", "mb": 0, "pipeline": 0, "stage": 1}]]}'
    s = Schedule.loads(text)
    assert s.placement == ((0, 1),)
    validate(s)
