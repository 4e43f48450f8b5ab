# The body both batch scripts share (sourced after they set their defaults): one job of a run that may
# take many jobs. It loads from where it saves, so a requeued or chained job continues the run; a job
# that finds the run complete exits 0 at once; each rank is a task of one srun step, so Slurm's warning
# signal (#SBATCH --signal, preemption) reaches every rank, and --exit-signal-handler makes them save
# and exit 0 together.
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
LATEST=$(cat "$SAVE/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
if [[ $LATEST =~ ^[0-9]+$ ]] && (( LATEST >= TRAIN_ITERS )); then
    echo "job ${SLURM_JOB_ID:-}: training already complete (iteration $LATEST of $TRAIN_ITERS in $SAVE): nothing to do"
    exit 0
fi
echo "job ${SLURM_JOB_ID:-} (restart ${SLURM_RESTART_COUNT:-0}): resuming from iteration $LATEST of $TRAIN_ITERS in $SAVE"

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A rank per task (--ntasks-per-node), not torchrun: on SIGTERM torchrun kills its workers after 30 s
# and exits non-zero.
srun --kill-on-bad-exit=1 \
    bash -c 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec python pretrain_gpt.py "$@"' \
    pretrain_gpt.py \
    --pipeline-schedule "$SCHEDULE" ${CHIMERA_CONCAT:+--chimera-concat "$CHIMERA_CONCAT"} \
    ${CHIMERA_ORDER:+--chimera-order "$CHIMERA_ORDER"} \
    --pipeline-model-parallel-size "$PP" --tensor-model-parallel-size "$TP" \
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
    --lr "$LR" --lr-decay-style cosine --min-lr "$(python -c "print($LR / 10)")" --lr-warmup-iters "$WARMUP" \
    --data-path "$DATA_PATH" --split "$SPLIT" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" \
    --save "$SAVE" --load "$SAVE" --save-interval "$SAVE_INTERVAL" --exit-signal-handler $EXTRA_ARGS
