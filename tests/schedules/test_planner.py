"""The planner's memory filter and ranking on cases small enough to compute by hand, and the
benchmark's bubble measurement on a synthetic trace with known idle time."""
import json

import pytest

from chimera_schedules import Action, build
from chimera_schedules.analysis.measure import measured_result
from chimera_schedules.ir.costs import Event
from chimera_schedules.tools.planner import (
    Candidate,
    Experts,
    ModelShape,
    Precision,
    Profile,
    costs,
    evaluate,
    even_layout,
    model_state_bytes,
    plan,
    worker_memory,
)

SHAPE = ModelShape(layers=4, hidden=64, heads=4, seq=32, vocab=0)  # no logits: equal stages


def profile(memory: float, flops: float = 1e9) -> Profile:
    return Profile("test", flops=flops, p2p_latency=0.0, p2p_bandwidth=float("inf"), allreduce_latency=0.0,
                   allreduce_bandwidth=float("inf"), memory=memory)


def test_memory_is_weights_of_every_copy_plus_peak_activations():
    # params per layer 12 h^2 + 13 h = 49,984; no vocabulary, so no embedding or output matrix.
    # A stage: 2 layers = 99,968 params, x 16 bytes = 1,599,488. Activations in fp32: s b h (66 + 9 a s / h)
    # (half precision's 34 + 5 a s / h with every value of 4 bytes, the dropout masks of 1)
    # = 32 x 64 x 84 = 172,032 bytes per layer per micro-batch; 2 layers x peak 2 micro-batches = 688,128.
    one = evaluate(SHAPE, profile(3e6), 2, Candidate("1f1b", 2, 1, 1, 2))
    chimera = evaluate(SHAPE, profile(3e6), 2, Candidate("chimera direct", 2, 1, 1, 2))
    assert one.memory == 1_599_488 + 688_128 and one.fits
    assert chimera.memory == 2 * 1_599_488 + 688_128 and not chimera.fits  # two stage copies per worker
    half = evaluate(SHAPE, profile(3e6), 2, Candidate("1f1b", 2, 1, 1, 2), Precision(half=True))
    # bf16 with fp32 main weights: 18 bytes per parameter; s b h (34 + 5 a s / h) = 90,112 bytes per layer
    assert half.memory == 99_968 * 18 + 2 * 2 * 90_112, "half precision's activations are Korthikanti's"


def test_ranking_matches_hand_computed_makespans():
    # forward of a stage = 2 layers x 24 b s h^2 (1 + s / 6h) FLOPs; choose the rate that makes it 1 s
    f = 2 * SHAPE.layer_forward_flops(1)
    ranked = plan(2, 2, SHAPE, profile(1e12, flops=f), depths=[2], micro_batches=[1])
    times = {c.schedule: c.seconds for c in ranked}
    # 1F1B and GPipe, D=2, N=2, B=2F: (N + D - 1)(F + B) = 9; Chimera: both workers F, F, B, B with the
    # second backward waiting for the peer's first one: 6
    assert times["1f1b"] == pytest.approx(9.0) and times["gpipe"] == pytest.approx(9.0)
    assert times["chimera direct"] == pytest.approx(6.0)
    assert ranked[0].schedule == "chimera direct"
    assert "chimera doubling" not in times  # N=2 is not a multiple of 2D: the schedule library says no


def test_layouts_that_do_not_fit_rank_last():
    ranked = plan(2, 2, SHAPE, profile(3e6), depths=[2], micro_batches=[1])
    assert [c.fits for c in ranked] == sorted((c.fits for c in ranked), reverse=True)
    assert ranked[0].schedule in ("1f1b", "gpipe", "1f1b split") and ranked[-1].schedule.startswith("chimera")


def test_bubble_measurement_on_a_synthetic_trace():
    s = build("1f1b", 2, 1)
    events = [Event(0, Action.parse("F0p0s0"), 0.0, 1.0), Event(1, Action.parse("F0p0s1"), 1.5, 2.5),
              Event(1, Action.parse("B0p0s1"), 2.5, 4.5), Event(0, Action.parse("B0p0s0"), 5.0, 7.0)]
    result = measured_result(s, events, makespan=8.0, activation_bytes={(0, 0, 0): 100, (0, 1, 0): 40})
    assert result.busy == [3.0, 3.0] and result.idle == [5.0, 5.0]
    assert result.bubble_ratio == pytest.approx(10.0 / 16.0)
    assert result.peak_activations == [100, 40]


def test_moe_costs_count_routed_and_shared_experts_and_the_all_to_all():
    # 2 layers, the second MoE: 4 experts of width 8, top-2, a shared one of width 8; SwiGLU (3 matrices)
    shape = ModelShape(layers=2, hidden=16, heads=2, seq=4, vocab=0, ffn=32, gated=True,
                       experts=Experts(count=4, topk=2, ffn=8, moe_layers=1, shared_ffn=8))
    attention = 8 * 4 * 16 ** 2 + 4 * 4 ** 2 * 16  # b=1: 8 b s h^2 + 4 b s^2 h
    assert shape.layer_forward_flops(1) == attention + 2 * 4 * 16 * 3 * 32
    assert shape.moe_layer_forward_flops(1) == attention + 2 * 4 * 16 * (3 * (2 * 8 + 8) + 4)  # + the router
    shared, routed = shape.moe_layer_params(expert_parallel=2)
    assert shared == 4 * 16 ** 2 + 2 * 16 + 16 * 4 + 3 * 16 * 8 and routed == 2 * 3 * 16 * 8  # 2 of 4 experts
    p = Profile("test", flops=1.0, p2p_latency=1.0, p2p_bandwidth=2.0, allreduce_latency=0.0,
                allreduce_bandwidth=float("inf"), memory=1e12)
    # dispatch and combine: 2 x (latency + tokens x hidden x 2 bytes x top-k x (EP-1)/EP / bandwidth)
    model = costs(shape, p, depth=2, b=1, width=2, ep=2)
    assert model.forward == [shape.layer_forward_flops(1),
                             shape.moe_layer_forward_flops(1) + 2 * (1 + 64 * 2 * 2 / 2 / 2)]


def test_planner_counts_expert_memory_per_expert_parallel_rank():
    shape = ModelShape(layers=2, hidden=16, heads=2, seq=4, vocab=0, ffn=32, gated=True,
                       experts=Experts(count=64, topk=2, ffn=64, moe_layers=2))
    one, eight = (evaluate(shape, profile(1e12), 8, Candidate("1f1b", 2, 8, 1, 1, ep)) for ep in (1, 8))
    per_rank = 64 // 8 * 3 * 16 * 64  # the routed experts of one layer per rank at EP=8
    assert one.memory - eight.memory == 16 * (64 * 3 * 16 * 64 - per_rank)  # fp32: 16 bytes per parameter


def test_context_parallelism_divides_activations_and_widens_the_optimizers_shards():
    # the first test's 1F1B D=2: a stage's weights 1,599,488 bytes (fp32, 16 bytes per parameter), peak
    # activations 688,128; at CP=2 each rank keeps half of every micro-batch's sequence, and with the
    # distributed optimizer its main weights' moments (8 of the 16 bytes) split over DP x CP = 2 replicas
    schedule = build("1f1b", 2, 2)
    held = even_layout(SHAPE, 2)
    assert worker_memory(SHAPE, schedule, held, 1, 1, cp=2) == 1_599_488 + 688_128 / 2
    sharded = Precision(distributed_optimizer=True)
    assert worker_memory(SHAPE, schedule, held, 1, 1, precision=sharded, cp=2) == 1_599_488 - 99_968 * 4 + 688_128 / 2


def test_muon_keeps_one_momentum_per_matrix_element_and_adamw_two_moments_for_the_rest():
    # a stage of 2 layers: 2 x 12 h^2 = 98,304 matrix elements (Muon: 4 bytes each instead of AdamW's 8);
    # the 2 x 13 h norms and biases keep AdamW's two moments
    muon = evaluate(SHAPE, profile(3e6), 2, Candidate("1f1b", 2, 1, 1, 2), Precision(muon=True))
    adam = evaluate(SHAPE, profile(3e6), 2, Candidate("1f1b", 2, 1, 1, 2))
    assert adam.memory - muon.memory == 4 * 2 * 12 * 64 ** 2
    state = model_state_bytes(100, 1, 1, Precision(muon=True), matrices=60)
    assert state["optimizer"] == 8 * 40 + 4 * 60, state
    # its layer-wise distributed optimizer divides the moments over the 4 replicas, not the fp32 main weights
    state = model_state_bytes(100, 1, 4, Precision(half=True, distributed_optimizer=True, muon=True), matrices=60)
    assert (state["main parameters"], state["optimizer"]) == (400, (8 * 40 + 4 * 60) / 4), state


def test_measured_stage_costs_sum_a_stages_parts_over_its_shards_with_the_all_to_all(tmp_path):
    """A stage-cost profile prices each stage as its parts add up: layers by kind, the loss where the layout
    puts L, MTP where it puts m; divided over TP x CP; each MoE layer's all-to-all from the hardware profile; a
    size it lacks from the nearest, in proportion; and a file round-trips."""
    from chimera_schedules.ir.layout import parse
    from chimera_schedules.tools.stage_profile import PassTimes, StageProfile

    parts = {"layer": PassTimes(1.0, 2.0), "moe_layer": PassTimes(3.0, 5.0), "output": PassTimes(7.0, 11.0),
             "mtp": PassTimes(13.0, 17.0)}
    measured = StageProfile("test", "by hand", {2: parts})
    measured.save(tmp_path / "p.json")
    assert StageProfile.load(tmp_path / "p.json") == measured, "the file did not round-trip"
    shape = ModelShape(layers=4, hidden=64, heads=4, seq=32, vocab=0, mtp=1,
                       experts=Experts(count=4, topk=1, ffn=64, moe_layers=2))  # layers 2 and 3 MoE, MTP too
    hardware = Profile("hw", flops=1e9, p2p_latency=0.5, p2p_bandwidth=float("inf"), allreduce_latency=0.0,
                       allreduce_bandwidth=float("inf"), memory=1e12)
    held = parse("Ett|ttmL")
    model = measured.priced(shape, hardware, 2, 1, ep=2, shards=2)(1, held, 4)  # size 4: twice size 2's times
    a2a = 2 * 0.5  # dispatch and combine, each one latency
    assert model.forward == [2 * 2 * 1.0 / 2, 2 * (2 * 3.0 + 13.0 + 7.0) / 2 + 3 * a2a], model.forward
    assert model.backward == [2 * 2 * 2.0 / 2, 2 * (2 * 5.0 + 17.0 + 11.0) / 2 + 3 * a2a], model.backward


def test_a_profiles_halves_efficiency_prices_the_split_the_micro_batch_size_takes(tmp_path):
    """A measured profile's two efficiencies: an even micro-batch halves along its sequences, an odd one along
    each sequence; a profile without them computes halves at full rate."""
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"name": "gpu", "flops": 1e9, "p2p_latency": 0, "p2p_bandwidth": 1e9,
                                "allreduce_latency": 0, "allreduce_bandwidth": 1e9, "memory": 1e9,
                                "halves_efficiency": 0.9, "sequence_halves_efficiency": 0.8}))
    measured = Profile.load(str(path))
    efficiency = {b: costs(SHAPE, measured, 2, b, 1).halves_efficiency for b in (1, 2, 3)}
    assert efficiency == {1: 0.8, 2: 0.9, 3: 0.8}, f"halves' efficiency by micro-batch size: {efficiency}"
    assert costs(SHAPE, profile(1e9), 2, 1, 1).halves_efficiency == 1.0, "an unmeasured profile's"
