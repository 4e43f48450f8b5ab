#!/bin/bash
# Chimera and its baselines on the same model and data, one job each, for a side-by-side comparison:
#   scripts/slurm/submit_schedules.sh [single_node|multi_node] [extra sbatch options]
set -euo pipefail
kind=${1:-single_node}; shift || true
for schedule in chimera 1f1b gpipe; do
    sbatch --job-name="gpt-$schedule" --export="ALL,SCHEDULE=$schedule" "$@" \
        "$(dirname "$0")/pretrain_gpt_${kind}.sbatch"
done
