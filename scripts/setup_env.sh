#!/usr/bin/env bash
# Make .venv (Python >= 3.12, which megatron-core 0.19 needs) and install this project into it.
#
#   bash scripts/setup_env.sh          # the trainer
#   bash scripts/setup_env.sh test     # and the test suite's extras
#
# The interpreter is the first of: $PYTHON, python3.12 / python3.13 / python3 / python on PATH, then
# pyenv's installed versions (a pyenv shim answers on PATH only for the active version, so pyenv's
# folders are searched directly). An existing .venv on a new enough Python is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
VENV=.venv

new_enough() {  # an interpreter that runs and is 3.12 or newer
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

find_python() {
    local candidates=("${PYTHON:-}" python3.12 python3.13 python3 python)
    local root
    root="$(pyenv root 2>/dev/null || echo "${HOME:-/root}/.pyenv")"
    candidates+=("$root"/versions/3.1[2-9]*/bin/python3)
    for py in "${candidates[@]}"; do
        if [[ -n "$py" ]] && new_enough "$py"; then
            command -v "$py" || echo "$py"
            return 0
        fi
    done
    echo "scripts/setup_env.sh: no Python >= 3.12 found (megatron-core 0.19 needs it); set PYTHON=/path/to/python3.12" >&2
    return 1
}

venv_here() {  # a new enough .venv made in this folder (a moved one still points at its old path)
    new_enough "$VENV/bin/python" &&
        [[ "$("$VENV/bin/python" -c 'import sys; print(sys.prefix)')" == "$PWD/$VENV" ]]
}

if [[ -n "${PYTHON:-}" ]] && ! new_enough "$PYTHON"; then
    echo "scripts/setup_env.sh: PYTHON=$PYTHON is not a Python >= 3.12 (megatron-core 0.19 needs it)" >&2
    exit 1
fi
if ! venv_here; then
    python="$(find_python)"
    echo "creating $VENV with $python ($("$python" --version))"
    rm -rf "$VENV"
    "$python" -m venv "$VENV"
fi
# torch is pinned because an unpinned one can resolve past the release the rest was tested with; on
# Python 3.12 PyPI's torch is the CUDA build, which also runs on the CPU.
spec="."
[[ -n "$extras" ]] && spec=".[$extras]"
# pip compiles every installed module to bytecode on one core (about a minute: torch, transformers, ...);
# compileall does the same on every core. Done here, not left to the first import: with PYTHONDONTWRITEBYTECODE
# set (as on this project's machines) nothing would ever be cached, and each process would compile its imports.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 -e "$spec"
# As with pip's own compiling, a file that does not compile (a template, a test fixture) stays source: no failure.
"$VENV/bin/python" -W ignore -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
echo "installed into $VENV ($("$VENV/bin/python" --version)); activate with: . $VENV/bin/activate"
