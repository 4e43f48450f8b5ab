"""Chimera's successors on the same IR: BitPipe, the controllable-memory V schedules and Hanayo's waves,
against the figures their authors state (docs/schedules.md, "Chimera beside its successors")."""
import pytest

from chimera_schedules import CostModel, build, simulate
from chimera_schedules.generators.hanayo import wave_placement
from chimera_schedules.ir.errors import ConfigError

pytestmark = pytest.mark.unit

UNIT = CostModel(forward=1.0, backward=2.0)  # F = 1, B = 2 per 1F1B stage; a chunk of half a stage costs half
EQUAL = CostModel(forward=1.0, backward=2.0, weight=1.0)  # the V schedules' paper: F = I = W


def one_f_one_b_bubble(depth: int, microbatches: int) -> float:
    return (depth - 1) / (microbatches + depth - 1)


def test_bitpipe_reproduces_the_authors_figure_d4_n4():
    """The fork's BitPipe-v figure: D = 4, N = 4, chunk f = 1, b = 2 ends at 28 slots, 4 of them idle on
    every device; worker 0 runs the fork's order."""
    result = simulate(build("bitpipe", 4, 4), CostModel(forward=2.0, backward=4.0))
    assert result.makespan == 28, f"makespan {result.makespan}, the figure's 28"
    assert [round(i, 9) for i in result.idle] == [4.0] * 4, f"idle {result.idle}"
    first = build("bitpipe", 4, 4).tokens(0)
    assert first.split()[:8] == ["F0p0s0", "F1p0s0", "F2p1s3", "F2p1s4", "F3p1s3", "F3p1s4", "F0p0s7", "B0p0s7"], first


@pytest.mark.parametrize("depth", [4, 8])
@pytest.mark.parametrize("units", [1, 2, 3])
@pytest.mark.parametrize("f,b", [(1, 2), (1, 1), (2, 3)])
def test_bitpipe_idles_d_minus_2_backwards_per_worker_plus_its_concatenation(depth, units, f, b):
    """(D-2) (b + (k-1)(b-f)) per worker at N = kD, chunk times f and b: its D-2 bubbles of a backward,
    and each further unit joined by direct concatenation adds (D-2)(b-f)."""
    result = simulate(build("bitpipe", depth, units * depth), CostModel(forward=2.0 * f, backward=2.0 * b))
    expected = (depth - 2) * (b + (units - 1) * (b - f))
    assert {round(i, 9) for i in result.idle} == {expected}, f"idle {result.idle}, expected {expected}"


def test_bitpipe_holds_two_copies_and_its_peak_is_between_3d_plus_2_over_4_and_d():
    result = simulate(build("bitpipe", 8, 16), UNIT)
    assert result.weight_units == [2.0] * 8, result.weight_units
    assert (min(result.peak_activations), max(result.peak_activations)) == (6.5, 8.0), result.peak_activations


def test_bitpipe_refuses_n_that_is_not_a_multiple_of_d():
    with pytest.raises(ConfigError, match="multiple of"):
        build("bitpipe", 4, 6)


@pytest.mark.parametrize("depth,microbatches", [(4, 8), (4, 16), (6, 12), (8, 16), (8, 32)])
def test_v_min_and_v_half_hold_a_third_and_a_half_of_1f1b_and_bubble_as_the_paper_says(depth, microbatches):
    """Peak activations (p+4)//3 and (p+2)//2 micro-batches (the authors'), against 1F1B's p; at N >= 2D
    and F = I = W the bubble about 2/3 and 1/2 of 1F1B's (measured here: 0.65-0.72 and 0.31-0.49)."""
    ratio = {}
    for memory, peak in (("min", (depth + 4) // 3), ("half", (depth + 2) // 2)):
        result = simulate(build(f"v-{memory}", depth, microbatches, costs=EQUAL), EQUAL)
        assert max(result.peak_activations) == peak, f"v-{memory}: peak {result.peak_activations}, not {peak}"
        assert result.weight_units == [1.0] * depth
        ratio[memory] = result.bubble_ratio / one_f_one_b_bubble(depth, microbatches)
    assert 0.6 < ratio["min"] < 0.75, f"V-Min's bubble {ratio['min']:.2f} of 1F1B's, the paper's 2/3"
    assert ratio["half"] < 0.5, f"V-Half's bubble {ratio['half']:.2f} of 1F1B's, the paper's 1/2"


@pytest.mark.parametrize("depth,microbatches", [(4, 8), (8, 16), (8, 32)])
def test_v_zb_keeps_1f1b_memory_with_a_fraction_of_its_bubble(depth, microbatches):
    result = simulate(build("v-zb", depth, microbatches, costs=EQUAL), EQUAL)
    assert max(result.peak_activations) == depth, result.peak_activations
    ratio = result.bubble_ratio / one_f_one_b_bubble(depth, microbatches)
    assert ratio < 0.3, f"V-ZB's bubble {ratio:.2f} of 1F1B's"


def test_hanayo_waves_cross_the_workers_down_and_up_with_one_copy():
    assert wave_placement(3, 2) == ((0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0),)
    one, two = (simulate(build("hanayo", 4, 8, waves=w, costs=UNIT), UNIT) for w in (1, 2))
    assert one.weight_units == two.weight_units == [1.0] * 4
    assert two.makespan < one.makespan < simulate(build("1f1b", 4, 8), UNIT).makespan, (two.makespan, one.makespan)


def test_waves_apply_to_hanayo_only():
    with pytest.raises(ConfigError, match="hanayo only"):
        build("1f1b", 4, 8, waves=2)


@pytest.mark.parametrize("latency", [0.0, 0.2, 0.6])
@pytest.mark.parametrize("weight", [None, 0.5])
def test_v_zb_builds_at_any_costs_within_1f1b_memory(latency, weight):
    """A greedy order under the cap must not lock a worker's memory with one leg's forwards (the other leg's
    first micro-batch keeps a slot): at the depth benchmark's message costs it once found no order."""
    costs = CostModel(forward=1.0, backward=2.0, p2p_latency=latency, weight=weight)
    for depth, microbatches in ((2, 2), (4, 8), (8, 16)):
        result = simulate(build("v-zb", depth, microbatches, costs=costs), costs)
        assert max(result.peak_activations) <= depth, (depth, microbatches, result.peak_activations)


@pytest.mark.parametrize("name", ["hanayo", "v-zb"])
def test_a_stage_that_costs_nothing_does_not_stall_the_greedy_orders(name):
    """A measured stage can cost 0 (the embedding alone): an action that ends where it starts must still
    finish, not leave the list scheduler with nothing upcoming (it returned no order, and Hanayo failed)."""
    costs = CostModel(forward=[0.0, 1.0, 1.0, 1.0], backward=[0.0, 2.0, 2.0, 2.0])
    result = simulate(build(name, 2, 4, costs=costs), costs)
    assert result.makespan > 0, result.makespan
