#!/bin/bash
# Chimera and its baselines on the same model and data, side by side, from the repository's root:
#   recipes/slurm/submit_schedules.sh [--chain K] [single_node|multi_node] [extra sbatch options]
# --chain K submits K jobs per schedule, each starting when the previous one ends (afterany: also
# after a time limit or a failure); each continues from the last checkpoint, and those that find
# the run complete exit at once. SCHEDULES="chimera 1f1b" picks the schedules.
set -euo pipefail
chain=1
if [ "${1:-}" = --chain ]; then
    chain=$2
    shift 2
fi
kind=${1:-single_node}; shift || true
for schedule in ${SCHEDULES:-chimera 1f1b gpipe}; do
    previous=
    for _ in $(seq "$chain"); do
        previous=$(SCHEDULE=$schedule sbatch --parsable --job-name="gpt-$schedule" \
            ${previous:+--dependency=afterany:$previous} "$@" "$(dirname "$0")/pretrain_gpt_${kind}.sbatch")
        previous=${previous%%;*}
        echo "gpt-$schedule: job $previous"
    done
done
