#!/usr/bin/env bash
# Slurm and munge for the single-node cluster that tests/integration/test_slurm.py brings up (Debian packages).
# Without root or apt-get it installs nothing and says so; the Slurm test then skips with that reason.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_slurm.sh: Slurm is not installed and cannot be installed here (needs root and apt-get)"
    exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
echo "install_slurm.sh: installed $(slurmctld -V)"
