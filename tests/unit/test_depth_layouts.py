"""The depth benchmark's layouts, clock and fairness targets, without launching it: every layout of a
model runs on one clock, each schedule's layouts are found for its own placement, and the report reads
issue 32's targets off the rows."""
import dataclasses
import statistics

import pytest

from benchmarks.depth import layouts, models, report, runtimes
from benchmarks.depth.costs import default_profile, message_target_ms, stage_times
from chimera_schedules.ir import layout
from chimera_schedules.tools import balancer
from chimera_schedules.tools.planner import MODELS, Profile


@pytest.mark.parametrize("model", sorted(MODELS))
def test_one_clock_for_every_layout(model):
    """The even 1F1B split's median forward is --forward-ms; another layout moves time between stages
    but not the total (the same layers on the same clock)."""
    shape, profile = MODELS[model], Profile.load(default_profile(model))
    even = stage_times(shape, 4, 1, 20.0, profile)
    assert statistics.median(t.forward for t in even) == pytest.approx(0.020)
    per = shape.layers // 4
    counts = [per + 2, per, per, shape.layers - 3 * per - 2]
    moved = stage_times(shape, 4, 1, 20.0, profile, layout.from_counts(counts, shape.mtp))
    assert moved[0].forward > even[0].forward
    assert sum(t.forward for t in moved) == pytest.approx(sum(t.forward for t in even))


def test_a_message_costs_the_profiles_share_of_a_stage():
    """GPT-2 1.3B on Piz Daint: 632 x 1280 bf16 at 10 GB/s and 2 us is 0.164 ms, beside a 28.7 ms stage."""
    profile = Profile.load(default_profile("gpt2-1.3b"))
    assert message_target_ms(MODELS["gpt2-1.3b"], profile, 8, 20.0) == pytest.approx(0.114, abs=0.002)


def test_each_kind_is_found_for_the_schedule():
    setup = runtimes.Setup(4, 20.0, "llama3-8b", Profile.load(default_profile("llama3-8b")), MODELS["llama3-8b"],
                           p2p_ms=0.5)
    skipped = []
    found = {c.kind: c for c in layouts.choose(setup, runtimes.megatron_order(4, 8, "1f1b"), layouts.KINDS,
                                               skipped, "1f1b")}
    assert set(found) == set(layouts.KINDS) and not skipped
    assert found["even"].layout == layout.even(32, 4)
    assert found["megatron"].flags  # the even split loses to the last stage's logits
    assert balancer.per_rank(runtimes.megatron_order(4, 8, "interleaved v=2")) == 2
    assert balancer.per_rank(runtimes.ours_schedule(setup, "chimera direct", 8)) == 1


def _row(runtime, schedule, kind, n, ms, predicted=None):
    return {"model": "llama3-8b", "runtime": runtime, "schedule": schedule, "layout_kind": kind, "layout": kind,
            "D": 8, "N": n, "ms": ms, "ms_min": ms - 5, "ms_max": ms + 5, "samples_ms": [ms - 5, ms + 5],
            "predicted_ms": predicted or ms, "measured_over_predicted": ms / (predicted or ms),
            "peak_activations": 8, "weight_copies": 1}


def test_fairness_targets_read_off_the_rows():
    rows = [_row("megatron-core", "1f1b", "even", 8, 1200), _row("megatron-core", "1f1b", "megatron", 8, 1000),
            _row("megatron-core", "1f1b", "balanced", 8, 1004), _row("ours", "chimera direct", "even", 8, 900),
            _row("ours", "chimera direct", "balanced", 8, 850, predicted=800),
            _row("ours", "chimera doubling", "balanced", 8, 860, predicted=850)]
    fair = report.fair_ratios(rows)
    assert [(f["chimera"], f["megatron_kind"], round(f["value"], 3)) for f in fair] == [
        ("chimera direct", "megatron", round(1000 / 850, 3))]
    targets = report.fairness_targets(rows, report.layout_wins(rows), fair)
    met = {name.split(" ")[0]: t["met"] for name, t in targets.items()}
    assert met == {"balanced": True, "best": True, "executor": False}  # 850 / 800 is 6% off at N = D


def test_a_launch_scripts_model_flags_give_the_planners_shape(tmp_path):
    """--model-flags: the trainer's parser reads the file as a shell would (continuations, comments), and
    the shape is Llama 3 8B's, as planner.MODELS has it."""
    flags = tmp_path / "llama3-8b.flags"
    flags.write_text("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 8192 \\\n"
                     "  --max-position-embeddings 8192 --ffn-hidden-size 14336 --swiglu  # Llama 3 8B\n"
                     "--tokenizer-type NullTokenizer --vocab-size 128256\n")
    shape, want = models.shape_of("gpt2-1.3b", str(flags)), MODELS["llama3-8b"]
    assert dataclasses.replace(shape, stores_attention_scores=False) == want, f"{shape} against {want}"
    assert models.name_of("gpt2-1.3b", str(flags)) == "llama3-8b"


@pytest.mark.parametrize("auto_ms,met", [(102.9, True), (103.1, False)])
def test_the_auto_row_is_held_to_the_best_row_of_its_run(auto_ms, met):
    def row(runtime, schedule, ms, kind="even", n=8):
        return {"runtime": runtime, "schedule": schedule, "D": 8, "N": n, "ms": ms, "layout_kind": kind,
                "model": "llama3-8b", "measured_over_predicted": 1.0}
    rows = [row("ours", "chimera direct", 110.0), row("megatron-core", "1f1b", 100.0, "megatron"),
            row("ours", "1f1b", 90.0, n=16), row("ours", "auto: chimera direct", auto_ms, "balanced")]
    got = report.auto_targets(rows)["auto within 3% of the best row, llama3-8b D=8 N=8"]
    assert got["met"] is met and got["value"] == pytest.approx(auto_ms / 100.0), got


def test_a_plain_stages_passes_are_priced_at_the_executor_host_cost_measured():
    """Without all-to-all the launch's measured host cost is each pass's (executor_host_ms): 1F1B at D=2, N=2
    predicted with 1 ms per pass is longer by what the passes on its critical path add: worker 0's F0, worker
    1's F0, B0, F1 and B1, worker 0's B1; one pass each forward, two each whole backward (its I and its W)."""
    from benchmarks.depth.costs import cost_model, predict
    from chimera_schedules import build

    times = stage_times(MODELS["gpt2-1.3b"], 2, 1, 20.0, Profile.load(default_profile("gpt2-1.3b")))
    schedule = build("1f1b", 2, 2)
    plain, priced = (predict(schedule, cost_model(times, 0.0, host_ms=h), True)["predicted_ms"] for h in (0.0, 1.0))
    assert priced - plain == pytest.approx(1 + 1 + 2 + 1 + 2 + 2), f"1 ms per pass added {priced - plain} ms"
