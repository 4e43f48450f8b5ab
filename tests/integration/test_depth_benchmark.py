"""The depth benchmark's smallest case: every runtime completes on the emulated device and the JSON
has its fields, at the even layout (the layout kinds and their targets are tests/unit/test_depth_layouts.py's).
No time is checked here (the benchmark itself measures)."""
import json
import subprocess
import sys

from megatron.chimera.testing.launch import ROOT

COLUMNS = {"runtime", "schedule", "D", "N", "ms", "ms_min", "ms_max", "predicted_ms", "bubble", "predicted_bubble",
           "model", "layout", "layout_kind"}


def test_every_runtime_completes_on_the_emulated_device(tmp_path):
    out = tmp_path / "depth.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.depth", "--stages", "4", "--microbatches", "8",
                           "--forward-ms", "2", "--rounds", "1", "--layouts", "even",
                           "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {r["runtime"] for r in rows} == {"ours", "megatron-core", "torch"}
    assert all(COLUMNS <= set(r) for r in rows)
    cases = {(r["runtime"], r["schedule"]) for r in rows}
    assert {("megatron-core", "1f1b"), ("megatron-core", "interleaved v=2"), ("torch", "zbv"),
            ("torch", "dualpipev"), ("torch", "interleaved zero bubble v=2"), ("ours", "chimera split"),
            ("ours", "dualpipev")} <= cases
    assert not doc["skipped"]  # N = 2D: every schedule's rules allow it
    assert set(doc["targets"]) and (tmp_path / "depth.png").exists() and (tmp_path / "depth.md").exists()
