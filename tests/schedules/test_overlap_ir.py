"""Overlapped F&B actions (issue 35): their token and JSON forms, what the validator accepts, what the
overlap pass fuses, that lowering and the NCCL checker take them, and what the simulator charges."""
import dataclasses

import pytest

from chimera_schedules import VARIANTS, Action, CostModel, InvalidSchedule, Schedule, build, simulate, validate, variant
from chimera_schedules.analysis.communicators import communicators
from chimera_schedules.analysis.nccl_model import MODES, check
from chimera_schedules.analysis.simulator import peak_activations
from chimera_schedules.ir.actions import B, F, Halved, Op, Overlapped, parts
from chimera_schedules.ir.dataflow import consumed_messages, forward_only, produced_messages
from chimera_schedules.ir.spec import ScheduleSpec
from chimera_schedules.passes.lowering import lower
from chimera_schedules.passes.overlap import REFERENCE, _Timed, overlap_forward_backward
from chimera_schedules.registry import build_spec
from chimera_schedules.tools.cli import main
from chimera_schedules.tools.render import _boxes, ascii_timeline, svg_timeline

OVERLAPPED = ("1f1b overlap", "chimera direct overlap", "chimera split overlap", "dualpipe overlap",
              "dualpipev overlap")


@pytest.fixture(scope="module")
def schedules():
    return {name: build_spec(variant(name, 4, 8)) for name in OVERLAPPED}


def fused(schedule: Schedule) -> list[Overlapped]:
    return [a for w in schedule.workers for a in w if a.op is Op.OVERLAPPED]


def test_token_and_json_round_trip():
    a = Action.parse("F3p0s1&B1p1s6")
    assert a == Overlapped(F(3, 0, 1), B(1, 1, 6)) and str(a) == "F3p0s1&B1p1s6"
    assert a.op is Op.OVERLAPPED and parts(a) == (F(3, 0, 1), B(1, 1, 6)) and parts(F(0, 0, 0)) == (F(0, 0, 0),)
    assert a.to_json() == {"op": "FB", "forward": F(3, 0, 1).to_json(), "backward": B(1, 1, 6).to_json()}
    assert Action.from_json(a.to_json()) == a and str(Action.parse("F2p0s0&I0p0s0")) == "F2p0s0&I0p0s0"
    assert not hasattr(a, "mb") and not hasattr(a, "stage")  # readers must go through parts()
    for bad in ("F1p0s0&B0p0s0&F2p0s0", "F1p0s0&sA0p0s1>1@down"):
        with pytest.raises(ValueError):
            Action.parse(bad)


def test_schedule_json_round_trip_and_placement_inference(schedules):
    s = schedules["dualpipe overlap"]
    assert Schedule.loads(s.dumps()) == s and s.meta["overlap"] and s.name == "dualpipe"
    obj = s.to_json()
    del obj["placement"]
    assert Schedule.from_json(obj).placement == s.placement


@pytest.mark.parametrize("name", OVERLAPPED)
def test_the_pass_fuses_pairs_and_keeps_each_workers_order(name, schedules):
    """At the trainer's costs (no all-to-all) the pass judges by REFERENCE's, and still fuses pairs
    (with --no-halves): every variant but chimera split, where each pair would lengthen the iteration.
    With halves, what it keeps has pairs or halves, each worker's order unchanged."""
    s, plain = schedules[name], build_spec(dataclasses.replace(variant(name, 4, 8), overlap=None))
    validate(s)
    assert bool(fused(overlap_forward_backward(plain, halves=False))) == (name != "chimera split overlap")
    assert fused(s) or any(a.op is Op.HALVED for w in s.workers for a in w), f"{name}: nothing overlapped"
    assert s == overlap_forward_backward(plain) == overlap_forward_backward(plain, REFERENCE)
    assert all(a.op is not Op.BACKWARD_WEIGHT for o in fused(s) for a in o.parts), f"{name}: a W paired: {fused(s)}"
    assert all(o.forward.op is Op.FORWARD and o.backward.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and
               o.forward.mb != o.backward.mb for o in fused(s)), f"{name}: pairs {fused(s)}"
    for w in range(s.depth):
        position = {a: i for i, a in enumerate(plain.workers[w])}
        order = [p for a in s.workers[w] for p in sorted(parts(a), key=position.__getitem__)
                 if p.op is not Op.REDUCE_GRADS]
        assert order == [a for a in plain.workers[w] if a.op is not Op.REDUCE_GRADS]
        assert {a for a in s.workers[w] if a.op is Op.REDUCE_GRADS} == {a for a in plain.workers[w]
                                                                          if a.op is Op.REDUCE_GRADS}
    assert s.split_backward == plain.split_backward
    assert all(o <= p + 1 for o, p in zip(peak_activations(s), peak_activations(plain))), \
        f"{name}: peaks {peak_activations(s)}, unpaired {peak_activations(plain)}"  # a pair's F counts first


def test_validator_rejects_two_forwards_one_micro_batch_and_a_cross_worker_cycle():
    s = build("1f1b", 2, 2)  # worker 0: F0 F1 B0 B1 R; worker 1: F0 B0 F1 B1 R
    w0, w1 = list(s.workers[0]), list(s.workers[1])
    two_forwards = dataclasses.replace(s, workers=(tuple([Overlapped(w0[0], w0[1])] + w0[2:]), s.workers[1]))
    with pytest.raises(InvalidSchedule, match="one forward .F. and one backward") as info:
        validate(two_forwards)
    assert info.value.worker == 0
    same = dataclasses.replace(s, workers=(s.workers[0], tuple([w1[0], Overlapped(w1[2], w1[3]), w1[1]] + w1[4:])))
    with pytest.raises(InvalidSchedule, match="different micro-batches"):
        validate(same)
    cycle = dataclasses.replace(s, workers=(tuple([w0[0], Overlapped(w0[1], w0[2])] + w0[3:]),
                                            tuple([w1[0], Overlapped(w1[2], w1[1])] + w1[3:])))
    with pytest.raises(InvalidSchedule, match="deadlock: cross-worker cycle") as info:
        validate(cycle)
    assert "F1p0s0&B0p0s0" in str(info.value) and "F1p0s1&B0p0s1" in str(info.value)
    assert validate(overlap_forward_backward(s)) is None


def test_the_pass_never_fuses_a_pair_that_waits_for_its_own_result():
    """1F1B D=2, N=2: with worker 1's B0&F1 fused, worker 0's F1&B0 would wait for B0 on worker 1, which
    waits for F1 from worker 0: the trial is refused before any replay, and nothing changes."""
    s = build("1f1b", 2, 2)
    timed = _Timed(s, REFERENCE)
    (i0, j0), (i1, j1) = sorted(timed.candidates(), key=lambda pair: timed.worker[pair[0]])
    assert timed.try_pair(i1, j1) and timed._leads_to_inputs(i0, j0)
    before = (list(timed.start), list(timed.end), timed.makespan)
    assert not timed.try_pair(i0, j0) and (timed.start, timed.end, timed.makespan) == before
    assert [str(a) for a in timed.workers()[1]] == ["F0p0s1", "F1p0s1&B0p0s1", "B1p0s1", "Rp0s1"]


def test_dataflow_of_an_overlapped_action_is_its_parts():
    s = build("1f1b", 4, 8)
    a = Overlapped(F(5, 0, 1), B(2, 0, 1))
    assert consumed_messages(s, a) == [("act", 0, 1, 5), ("grad", 0, 1, 2)]
    assert produced_messages(s, a) == [("act", 0, 2, 5), ("grad", 0, 0, 2)]
    assert consumed_messages(s, F(0, 0, 0)) == [] and produced_messages(s, B(0, 0, 0)) == []


@pytest.mark.parametrize("name", OVERLAPPED)
def test_lowered_overlapped_schedules_pass_the_nccl_checker(name, schedules):
    lowered = lower(schedules[name])
    for mode in MODES:
        check(lowered, mode)
    assert communicators(lowered) == communicators(lower(build_spec(dataclasses.replace(variant(name, 4, 8),
                                                                                        overlap=None))))
    evaluation = forward_only(lowered)
    assert all(a.op in (Op.FORWARD, Op.SEND, Op.RECV) for w in evaluation.workers for a in w), evaluation.workers
    check(evaluation, "nccl")


def test_costs_of_an_overlapped_action():
    s = build("dualpipe", 4, 8)
    pair = Overlapped(F(4, 1, 1), B(0, 0, 1))
    plain = CostModel(1.0, 2.0)
    assert plain.compute_time(s, pair) == pytest.approx(3.0)  # no all-to-all: no gain, F + B
    moe = CostModel(1.0, 2.0, a2a=0.5, moe_layers=4)
    alone = moe.compute_time(s, F(4, 1, 1)) + moe.compute_time(s, B(0, 0, 1))
    assert alone == 1.5 + 2.5 and moe.compute_time(s, pair) == pytest.approx(3.0)  # hidden behind compute
    heavy = CostModel(1.0, 2.0, a2a=4.0, moe_layers=4)  # more all-to-all than compute: the rest shows
    assert heavy.compute_time(s, pair) == pytest.approx(8.0) and heavy.compute_time(s, F(4, 1, 1)) == 5.0
    split = CostModel(1.0, 2.0, weight=0.5, a2a=[0.5] * 8)
    assert split.compute_time(s, Action(Op.BACKWARD_INPUT, 0, 0, 1)) == 2.0
    assert split.compute_time(s, Action(Op.BACKWARD_WEIGHT, 0, 0, 1)) == split.weight == 0.5


def test_overlap_hides_the_all_to_all_in_dualpipe():
    moe = CostModel(1.0, 2.0, a2a=0.5, moe_layers=4)
    plain, overlapped = build("dualpipe", 8, 16), build("dualpipe", 8, 16, overlap=True)
    assert simulate(overlapped, moe).makespan < simulate(plain, moe).makespan
    assert simulate(overlapped, CostModel()).makespan >= simulate(plain, CostModel()).makespan


@pytest.mark.parametrize("a2a", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("depth, microbatches", [(4, 8), (8, 16)])
def test_overlap_never_makes_a_schedule_slower_at_the_costs_it_is_built_for(a2a, depth, microbatches):
    """The issue's measurement (D=8, N=16, all-to-all half a forward): every pair fused made 1F1B
    92 -> 119 and Chimera 85 -> 95; the pass keeps only pairs that do not lengthen the iteration, and
    DualPipe's still pay."""
    costs = CostModel(1.0, 2.0, a2a=a2a, moe_layers=4)
    for name in OVERLAPPED:
        spec = variant(name, depth, microbatches)
        plain = build_spec(dataclasses.replace(spec, overlap=None), costs)
        overlapped = build_spec(spec, costs)
        assert overlapped == overlap_forward_backward(plain, costs)  # the registry passes its costs on
        assert simulate(overlapped, costs).makespan <= simulate(plain, costs).makespan, name
        if name.startswith("dualpipe"):
            pairs = build_spec(dataclasses.replace(spec, halves=False), costs)
            assert fused(pairs) and simulate(pairs, costs).makespan < simulate(plain, costs).makespan, name


def test_overlap_judges_with_transfers_and_reductions():
    """The pass's makespan is the simulator's, messages' delay and gradient all-reduces included, or
    later: the pass has a pair wait for both its inputs, the simulator each part for its own."""
    costs = CostModel(1.0, 2.0, a2a=0.7, moe_layers=2, p2p_latency=0.1, activation_bytes=1.0, p2p_bandwidth=5.0,
                      grad_bytes=4.0, allreduce_bandwidth=2.0, allreduce_latency=0.1)
    for name in OVERLAPPED:
        plain = build_spec(dataclasses.replace(variant(name, 4, 8), overlap=None), costs)
        timed = _Timed(plain, costs)
        for i, j in timed.candidates():
            timed.try_pair(i, j)
        overlapped = dataclasses.replace(plain, workers=timed.workers())
        validate(overlapped)
        assert simulate(overlapped, costs).makespan <= timed.makespan + 1e-9, name
        assert timed.makespan <= simulate(plain, costs).makespan


@pytest.mark.parametrize("name", [n for n in VARIANTS if "best" not in n])  # best: seconds of search
def test_no_all_to_all_prices_every_variant_as_before(name):
    try:
        s = build_spec(variant(name, 4, 8))
    except ValueError:  # a variant the sizes do not allow
        return
    zero = CostModel(a2a=[0.0] * s.stages_per_pipeline)
    assert simulate(s, zero).makespan == simulate(s, CostModel()).makespan
    if not any(a.op is Op.OVERLAPPED for w in s.workers for a in w):  # a pair's forward ends where its layers say
        layered = CostModel(a2a=0.0, moe_layers=[3] * s.stages_per_pipeline, attention_share=0.3)
        assert simulate(s, layered).makespan == pytest.approx(simulate(s, CostModel()).makespan), name


def test_peak_activations_count_the_forward_before_the_backward():
    s = build("1f1b", 2, 2)
    w1 = list(s.workers[1])  # F0 B0 F1 B1 R: peak 1
    moved = dataclasses.replace(s, workers=(s.workers[0], tuple([w1[0], Overlapped(w1[2], w1[1])] + w1[3:])))
    assert peak_activations(s)[1] == 1 and peak_activations(moved)[1] == 2


def test_pictures_and_cli(capsys, tmp_path, schedules):
    pairs = build_spec(dataclasses.replace(variant("dualpipev overlap", 4, 8), halves=False))
    assert "&B" in ascii_timeline(simulate(pairs)) and "/2" in ascii_timeline(simulate(schedules["dualpipev overlap"]))
    result = simulate(schedules["dualpipev overlap"])
    assert "<svg" in svg_timeline(result)
    halved = sum(1 for e in result.events if e.action.op is Op.HALVED)
    assert len(_boxes(result)[0]) == len(result.events) + len(fused(result.schedule)) + halved  # two boxes each
    assert main(["validate", "--schedule", "dualpipe", "-D", "4", "-N", "8", "--overlap", "--comm", "nccl"]) == 0
    assert main(["stats", "--schedule", "dualpipe", "-D", "4", "-N", "8", "--overlap", "--a2a", "0.5",
                 "--moe-layers", "4"]) == 0
    assert main(["show", "--schedule", "gpipe", "--overlap"]) == 2
    assert "applies to --schedule 1f1b or chimera or dualpipe or dualpipev or v-min or v-half or v-zb or hanayo or " \
        "bitpipe only" in capsys.readouterr().err
    streams = tmp_path / "streams.png"
    assert main(["show", "--schedule", "chimera", "-D", "4", "-N", "4", "--overlap", "--a2a", "0.5", "--moe-layers",
                 "4", "--contention", "0.15", "--streams", "1", "--out", str(streams)]) == 0 and streams.exists()
    assert main(["show", "--schedule", "chimera", "--no-halves"]) == 2
    assert "--no-halves=True: applies with --overlap only" in capsys.readouterr().err


def test_halved_actions_round_trip_and_price_below_the_whole():
    """``F3p0s1/2``: a token and JSON that read back; what it consumes and produces is the whole
    action's; two halves hide most of their all-to-all, a pass without one gains nothing."""
    h = Action.parse("B3p0s1/2")
    assert h == Halved(B(3, 0, 1)) and str(h) == "B3p0s1/2" and Action.from_json(h.to_json()) == h
    assert parts(h) == (B(3, 0, 1),)
    with pytest.raises(ValueError, match="only an F, B or I"):
        Halved(Action(Op.BACKWARD_WEIGHT, 0, 0, 0))
    s = build("chimera", 8, 8)
    moe = CostModel(1.0, 2.0, a2a=0.5, moe_layers=4)
    assert moe.compute_time(s, Halved(F(0, 0, 0))) < 1.5 - 0.4  # 1 of compute, 0.5 of all-to-all mostly hidden
    assert CostModel().compute_time(s, Halved(F(0, 0, 0))) == pytest.approx(1.0)


def test_the_host_cost_is_charged_per_issued_part():
    """``CostModel.host``: a plain stage's F one piece of work, its whole B two (I and W); through 4 MoE
    layers an F issues 16 parts (attention, dispatch, experts, combine per layer), a halved F 32 (some of
    their cost hidden beside the other stream's), and an overlapped pair pays for its parts too."""
    s, h = build("chimera", 8, 8), 0.01
    plain, moe = CostModel(1.0, 2.0, host=h), CostModel(1.0, 2.0, a2a=0.5, moe_layers=4)
    priced = dataclasses.replace(moe, host=h)
    assert plain.compute_time(s, F(0, 0, 0)) == pytest.approx(1.0 + h)
    assert plain.compute_time(s, B(0, 0, 0)) == pytest.approx(2.0 + 2 * h)
    assert priced.compute_time(s, F(0, 0, 0)) == pytest.approx(1.5 + 16 * h)
    halved = priced.compute_time(s, Halved(F(0, 0, 0))) - moe.compute_time(s, Halved(F(0, 0, 0)))
    assert 16 * h <= halved <= 32 * h + 1e-9, f"a halved F's 32 parts added {halved}"
    pair = Overlapped(F(0, 0, 0), B(1, 0, 0))
    assert priced.compute_time(s, pair) > moe.compute_time(s, pair)


@pytest.mark.parametrize("name", OVERLAPPED)
def test_halves_never_slow_the_pairs_down(name):
    """At the caller's costs the chosen order is never slower than the pairs alone (--no-halves), and
    Chimera split at N = D hides at least 80% of its all-to-all (issue 43's stats check)."""
    costs = CostModel(1.0, 2.0, a2a=0.5, moe_layers=4)
    spec = variant(name, 4, 8)
    with_halves = simulate(build_spec(spec, costs), costs).makespan
    pairs_only = simulate(build_spec(dataclasses.replace(spec, halves=False), costs), costs).makespan
    assert with_halves <= pairs_only + 1e-9, f"{name}: {with_halves} with halves, {pairs_only} pairs only"


def test_chimera_split_at_n_equals_d_hides_its_all_to_all():
    costs, plain = CostModel(1.0, 2.0, a2a=0.5, moe_layers=4), CostModel(1.0, 2.0)
    spec = ScheduleSpec("chimera", 8, 8, split_backward=True)
    off = simulate(build_spec(spec, costs), costs).makespan
    on = simulate(build_spec(dataclasses.replace(spec, overlap=True), costs), costs).makespan
    bare = simulate(build_spec(spec, plain), plain).makespan
    assert (off - on) / (off - bare) >= 0.8, f"hidden {(off - on) / (off - bare):.3f} ({off}, {on}, {bare})"


def _stats_makespan(capsys, *flags: str) -> float:
    """The makespan ``stats`` prints for Chimera split at D = N = 8 with ``flags``."""
    capsys.readouterr()
    assert main(["stats", "--schedule", "chimera", "-D", "8", "-N", "8", "--split-backward", "--moe-layers", "4",
                 *flags]) == 0
    return float(capsys.readouterr().out.splitlines()[1].split()[1])


def test_at_micro_batch_size_1_the_halves_of_each_sequence_hide_the_all_to_all(capsys):
    """Issue 54's stats check: at micro-batch size 1 the halves run along each sequence and hide at least 80%
    of Chimera split's all-to-all at N = D; priced at the halves' efficiency, a slower half hides less."""
    off, bare = _stats_makespan(capsys, "--a2a", "0.5"), _stats_makespan(capsys)
    on = _stats_makespan(capsys, "--a2a", "0.5", "--overlap", "--micro-batch-size", "1")
    assert (off - on) / (off - bare) >= 0.8, f"hidden {(off - on) / (off - bare):.3f} ({off}, {on}, {bare})"
    slower = _stats_makespan(capsys, "--a2a", "0.5", "--overlap", "--micro-batch-size", "1",
                             "--sequence-halves-efficiency", "0.85")
    batch = _stats_makespan(capsys, "--a2a", "0.5", "--overlap", "--micro-batch-size", "2",
                            "--sequence-halves-efficiency", "0.85")
    assert slower > on and batch == on, f"at 0.85: {slower} at size 1, {batch} at size 2 (the batch's halves); {on}"
