"""Installed beside Megatron-LM: megatron-core's wheel ships Megatron-LM's own ``megatron.training``
(since 0.17), and our trainer lives in ``megatron.chimera``, so from any directory a user gets both,
and ``torchrun <repo>/pretrain_gpt.py`` trains."""
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from megatron.chimera.distributed.ports import free_port
from megatron.chimera.testing.launch import ENV, ROOT

pytestmark = pytest.mark.slow
OUTSIDE_ENV = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}


def test_wheel_training_package_and_ours_import_side_by_side(tmp_path):
    probe = ("import megatron.core, megatron.training, megatron.chimera, megatron.training.arguments;"
             "print(megatron.training.__file__); print(megatron.chimera.__file__)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=OUTSIDE_ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs, ours = proc.stdout.split()
    assert "site-packages" in theirs and not theirs.startswith(os.path.join(ROOT, "megatron"))  # the wheel's
    assert ours == os.path.join(ROOT, "megatron", "chimera", "__init__.py")


def test_torchrun_of_the_repo_script_trains_from_another_directory(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"),
           "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--mock-data",
           "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
           "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
           "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=OUTSIDE_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert len(re.findall(r"iteration\s+\d+/\s*2 \|.* lm loss: \S+ \|", proc.stdout)) == 2
    assert os.listdir(tmp_path) == []  # nothing written where the user stood


def test_a_built_wheel_holds_every_module(tmp_path):
    """A wheel, as ``pip install .`` builds it from pyproject.toml, carries every sub-package (an
    editable install would not show a missing one). Built from a copy of the tracked files: setuptools
    builds in the source tree, and a stale build/ there could hide a module that is gone."""
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if os.path.exists(os.path.join(ROOT, name)):  # a file deleted but not yet committed is skipped
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(tmp_path), str(source)], env=OUTSIDE_ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("chimera_megatron-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        held = set(archive.namelist())
    for package in ("chimera_schedules", os.path.join("megatron", "chimera")):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    assert os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/") in held, name


def test_module_entry_point_draws_a_png(tmp_path):
    """python -m chimera_schedules, as a user runs it, draws a PNG."""
    png = tmp_path / "x.png"
    proc = subprocess.run([sys.executable, "-m", "chimera_schedules", "show", "--schedule", "chimera",
                           "--stages", "4", "--microbatches", "4", "--out", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
