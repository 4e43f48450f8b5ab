"""The IR's two textual forms round-trip; the simulator's cost model does what its docstring says."""
import pytest

from chimera_schedules import Action, CostModel, Op, Schedule, build, simulate, with_grad_sync


def test_token_round_trip():
    for token in ("F3p1s2", "B0p0s0", "I12p3s7", "W1p0s1", "Rp1s3"):
        assert str(Action.parse(token)) == token
    with pytest.raises(ValueError):
        Action.parse("R3p0s0")
    with pytest.raises(ValueError):
        Action.parse("X1p0s0")


@pytest.mark.parametrize("args", [("chimera", 4, 8), ("interleaved", 4, 8), ("chimera", 4, 4, {"concat": "halving"})])
def test_json_round_trip(args):
    name, d, n, *extra = args
    s = build(name, d, n, **(extra[0] if extra else {}))
    again = Schedule.loads(s.dumps())
    assert again == s
    assert set(s.to_json()) >= {"stages", "microbatches", "workers"}
    assert s.to_json()["workers"][0][0] == {"op": s.workers[0][0].op.value, "mb": s.workers[0][0].mb,
                                            "pipeline": s.workers[0][0].pipeline, "stage": s.workers[0][0].stage}


def test_grad_sync_is_eager_and_once_per_copy():
    s = build("chimera", 4, 4)
    for w in range(4):
        reductions = [a for a in s.workers[w] if a.op is Op.REDUCE_GRADS]
        assert sorted((a.pipeline, a.stage) for a in reductions) == sorted(s.held(w))
        for r in reductions:  # right after the copy's last backward
            i = s.workers[w].index(r)
            assert s.workers[w][i - 1].op is Op.BACKWARD
    assert with_grad_sync(s) == s


def test_p2p_latency_on_the_critical_path():
    # D=2, N=1: F on 0, send, F and B on 1, send, B on 0
    result = simulate(build("1f1b", 2, 1), CostModel(1, 2, p2p_latency=0.5))
    assert result.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2


def test_bandwidth_term_scales_with_activation_bytes():
    costs = CostModel(1, 1, p2p_latency=0.0, p2p_bandwidth=100.0, activation_bytes=50.0)
    assert simulate(build("1f1b", 2, 1), costs).makespan == 4 + 2 * 0.5


def test_allreduce_ends_the_iteration():
    # Chimera D=2: each stage has 2 copies; Rabenseifner with r = 2 copies x W=2 = 4
    costs = CostModel(1, 1, allreduce_latency=1.0, allreduce_bandwidth=10.0, grad_bytes=40.0, data_parallel=2)
    assert costs.allreduce_time(build("chimera", 2, 2), 2) == pytest.approx(2 * 2 * 1.0 + 2 * 3 / 4 * 40.0 / 10.0)
    plain = simulate(build("chimera", 2, 2), CostModel(1, 1))
    synced = simulate(build("chimera", 2, 2), costs)
    assert synced.makespan > plain.makespan
    assert synced.reductions and all(e.end <= synced.makespan for e in synced.reductions)


def test_single_copy_needs_no_allreduce():
    costs = CostModel(1, 1, allreduce_latency=5.0, grad_bytes=1.0, allreduce_bandwidth=1.0)
    assert simulate(build("1f1b", 4, 4), costs).makespan == simulate(build("1f1b", 4, 4), CostModel(1, 1)).makespan


def test_per_stage_costs():
    costs = CostModel(forward=[1, 3], backward=[2, 6])
    result = simulate(build("gpipe", 2, 1), costs)
    assert result.makespan == 1 + 3 + 6 + 2
    assert result.busy == [3, 9]
