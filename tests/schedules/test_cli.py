"""The command line a user meets: pictures, stats, export/validate round trip, one-line errors."""
import json
import xml.etree.ElementTree as ET

import pytest

from chimera_schedules.tools.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_svg_and_perfetto_trace(capsys, tmp_path):
    assert run(capsys, "show", "-D", "4", "--out", str(tmp_path / "t.svg"))[0] == 0
    root = ET.parse(tmp_path / "t.svg").getroot()
    assert sum(1 for el in root.iter() if el.tag.endswith("rect")) >= 16 + 1
    assert run(capsys, "show", "-D", "4", "--out", str(tmp_path / "t.json"))[0] == 0
    trace = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert len(spans) == 4 * 2 * 4 and max(e["ts"] + e["dur"] for e in spans) == 16_000


def test_ascii_timeline(capsys):
    code, out, _ = run(capsys, "show", "--schedule", "chimera", "--stages", "4", "--microbatches", "4")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("P")]
    assert len(rows) == 4 and rows[0].startswith("P0  |F0v|F1v|")
    assert "makespan 16" in out


def test_stats_json(capsys):
    code, out, _ = run(capsys, "stats", "--json", "--schedule", "chimera", "--stages", "8", "--microbatches", "8")
    stats = json.loads(out)
    assert code == 0
    assert stats["makespan"] == 36 and stats["bubble_ratio"] == pytest.approx(12 / 36, abs=1e-6)
    assert stats["peak_activations"] == [5, 6, 7, 8, 8, 7, 6, 5] and stats["stage_copies"] == [2] * 8


def test_depth_is_an_alias_of_stages(capsys):
    """--stages stays the option's name (and the JSON key); --depth spells the same D."""
    by_stages = run(capsys, "stats", "--json", "--stages", "4", "--microbatches", "8")
    assert run(capsys, "stats", "--json", "--depth", "4", "--microbatches", "8") == by_stages
    assert json.loads(by_stages[1])["stages"] == 4

def test_export_then_validate_then_stats_describe_the_same_schedule(capsys, tmp_path):
    opts = ["--schedule", "chimera", "--stages", "4", "--microbatches", "8"]
    path = tmp_path / "s.json"
    assert run(capsys, "export", *opts, "--out", str(path))[0] == 0
    assert run(capsys, "validate", str(path))[0] == 0
    from_file = json.loads(run(capsys, "stats", "--json", "--file", str(path))[1])
    from_opts = json.loads(run(capsys, "stats", "--json", *opts)[1])
    assert from_file == from_opts


def test_validate_names_the_offending_action(capsys, tmp_path):
    code, out, _ = run(capsys, "export", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2")
    doc = json.loads(out)
    doc["workers"][1].reverse()  # backwards before forwards on worker 1
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(doc))
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1
    assert err.strip() == ("invalid schedule: worker 1, action Rp0s1: "
                           "gradient reduction before the last backward of its stage copy")


@pytest.mark.parametrize("argv,needle", [
    (["--stages", "5"], "--stages=5: Chimera needs an even number of stages"),
    (["--stages", "0"], "--stages=0: must be at least 1"),
    (["--stages", "4", "--microbatches", "6"], "--microbatches=6: Chimera needs a multiple of --stages (4)"),
    (["--pipelines", "3"], "--pipelines=3: Chimera needs an even number of pipelines"),
    (["--stages", "8", "--pipelines", "6", "--microbatches", "24"], "--pipelines=6: P/2 must divide D/2 = 4"),
    (["--concat", "doubling", "--microbatches", "4"], "--microbatches=4: forward doubling pairs basic units"),
    (["--concat", "sideways"], "--concat=sideways: must be one of direct, doubling, halving"),
    (["--order", "best", "--concat", "doubling", "-N", "8"], "--concat=doubling: --order best builds its own order"),
    (["--schedule", "zigzag"], "--schedule=zigzag: must be one of gpipe, 1f1b, interleaved, chimera, dualpipe"),
    (["--schedule", "1f1b", "--chunks", "2"], "--chunks=2: applies to --schedule interleaved only"),
    (["--schedule", "gpipe", "--pipelines", "4"], "--pipelines=4: applies to --schedule chimera only"),
    (["--schedule", "interleaved", "--microbatches", "6"], "--microbatches=6: interleaved 1F1B needs a multiple"),
    (["--forward-time", "0"], "--forward-time=0.0: must be positive"),
    (["--split-backward", "--weight-time", "2"], "--weight-time=2.0: must be positive and less than --backward-time"),
    (["--schedule", "gpipe", "--split-backward"],
     "--split-backward=True: applies to --schedule 1f1b or chimera or hanayo or bitpipe only"),
    (["--schedule", "dualpipe", "--microbatches", "4"], "--microbatches=4: DualPipe needs an even number of at least"),
    (["--file", "/nonexistent/s.json"], "--file=/nonexistent/s.json: cannot read"),
])
def test_bad_input_is_one_line_with_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, "stats", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err


def test_unknown_picture_type(capsys, tmp_path):
    code, _, err = run(capsys, "show", "--out", str(tmp_path / "x.gif"))
    assert code == 2 and "--out=" in err and "must end in .png, .svg or .json" in err
    assert not (tmp_path / "x.gif").exists()


def test_compare_lists_every_schedule(capsys):
    code, out, _ = run(capsys, "compare", "--json", "--stages", "4", "--microbatches", "4")
    rows = {r["schedule"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["1f1b"]["makespan"] == 21 and rows["chimera direct"]["makespan"] == 16
    assert rows["1f1b split"]["makespan"] == 15 and rows["chimera split"]["makespan"] == 13
    assert rows["chimera split best"]["makespan"] == 13
    assert "skipped" in rows["dualpipe"]  # needs N >= 2 D
    assert "skipped" in rows["chimera doubling"]
