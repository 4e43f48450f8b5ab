#!/usr/bin/env bash
# Slurm and munge for the single-node cluster that tests/integration/test_slurm.py brings up (Debian packages).
# Without root or apt-get it installs nothing and says so; the Slurm tests then skip, and the suite's
# summary says so. Where it can install (root, apt-get), a failed install fails this script, loudly.
set -euo pipefail
trap 'echo "install_slurm.sh: FAILED to install Slurm and munge (line $LINENO); the Slurm tests need them" >&2' ERR
if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_slurm.sh: Slurm is not installed and cannot be installed here (needs root and apt-get)"
    exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
for tool in slurmctld slurmd munged; do
    command -v "$tool" >/dev/null || { echo "install_slurm.sh: FAILED: $tool missing after installing slurm-wlm and munge" >&2; exit 1; }
done
echo "install_slurm.sh: installed $(slurmctld -V)"
