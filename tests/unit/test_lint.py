"""The tree stays clean under ruff as pyproject.toml configures it (line length 120; rules E, F, I and
UP), so the suite's command checks style too."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_check_is_clean():
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")  # the installed tool, not a Python launch
    proc = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
