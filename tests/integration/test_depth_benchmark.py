"""The depth benchmark's smallest case: every runtime completes on the emulated device and the JSON
has its fields, at the even layout (the layout kinds and their targets are tests/unit/test_depth_layouts.py's).
No time is checked here (the benchmark itself measures)."""
import json
import subprocess
import sys

from megatron.chimera.testing.launch import ROOT

COLUMNS = {"runtime", "schedule", "D", "N", "ms", "ms_min", "ms_max", "predicted_ms", "bubble", "predicted_bubble",
           "model", "layout", "layout_kind"}


SCHEDULES = ["1f1b", "interleaved v=2", "chimera split", "dualpipev", "zbv", "interleaved zero bubble v=2", "auto"]


def test_every_runtime_completes_on_the_emulated_device(tmp_path):
    """Each runtime's schedules (a few of ours: every one is tests/schedules'), and the auto row: the plan
    --pipeline-schedule auto picks for a launch script's model flags, run beside them."""
    out, flags = tmp_path / "depth.json", tmp_path / "tiny-llama.flags"
    flags.write_text("--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 \\\n"
                     "  --max-position-embeddings 1024 --swiglu  # a launch script's model\n"
                     "--tokenizer-type NullTokenizer --vocab-size 32000\n")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.depth", "--stages", "4", "--microbatches", "8",
                           "--forward-ms", "2", "--rounds", "1", "--layouts", "even", "--model-flags", str(flags),
                           "--schedules", *SCHEDULES, "--runtimes", "ours", "megatron-core", "torch",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {r["runtime"] for r in rows} == {"ours", "megatron-core", "torch"}
    assert all(COLUMNS <= set(r) for r in rows), f"columns missing per row: {[sorted(COLUMNS - set(r)) for r in rows]}"
    cases = {(r["runtime"], r["schedule"]) for r in rows}
    assert {("megatron-core", "1f1b"), ("megatron-core", "interleaved v=2"), ("torch", "zbv"),
            ("torch", "dualpipev"), ("torch", "interleaved zero bubble v=2"), ("ours", "chimera split"),
            ("ours", "dualpipev")} <= cases
    assert not doc["skipped"]  # N = 2D: every schedule's rules allow it
    auto = [r for r in rows if r["schedule"].startswith("auto: ")]
    assert len(auto) == 1 and auto[0]["model"] == "tiny-llama", f"the auto rows: {auto}"
    assert any(name.startswith("auto within") for name in doc["targets"]), f"targets: {sorted(doc['targets'])}"
    assert set(doc["targets"]) and (tmp_path / "depth.png").exists() and (tmp_path / "depth.md").exists()


def test_forward_and_backward_overlapped_on_the_emulated_device(tmp_path):
    """--a2a-fraction at its smallest (D=2, 16 s here): DualPipe with overlap and without runs through
    schedule plans, and megatron-core's own combined 1F1B through the same emulated stages; the rows and
    the document have the overlap fields, the overlap row ran actions as pairs or in halves (at 2 ms stages
    of 30 MoE layers the measured host cost of a halved action's parts decides which), and only it and
    megatron-core's combined 1F1B ran an all-to-all inside another chain's compute."""
    out = tmp_path / "overlap.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.depth", "--stages", "2", "--model", "deepseek-v3",
                           "--a2a-fraction", "0.5", "--schedules", "dualpipe", "combined 1f1b v=2", "--microbatches",
                           "4", "--forward-ms", "2", "--rounds", "1", "--contention", "0", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    off, on = sorted((r for r in doc["rows"] if r["runtime"] == "ours"), key=lambda r: r["overlap"])
    assert (off["schedule"], on["schedule"]) == ("dualpipe", "dualpipe overlap")
    assert off["a2a_critical_ms"] == on["a2a_critical_ms"] > 0 and "predicted_hidden" in on
    assert off["a2a_overlapped_share"] == 0 < on["a2a_overlapped_share"], on
    assert on["halved_actions"] + on["overlapped_actions"] > 0 and doc["host_ms"]["2"] > 0, on
    combined = [r for r in doc["rows"] if r["runtime"] == "megatron-core"]
    assert [r["schedule"] for r in combined] == ["combined 1f1b v=2"] and combined[0]["a2a_overlapped_share"] > 0
    assert doc["overlap"] and doc["overlap_timeline"]["2"] and (tmp_path / "overlap.md").exists()
