# Shared by the MoE recipes: the launcher and the knobs a test or a user turns.
#   NPROC (4) processes; PP (2), EP (2); SCHEDULE (chimera: the one flag the recipes add to Megatron-LM's);
#   PRECISION (--bf16, as the recipes train; empty for fp32); TOKENIZER_MODEL (the README's SentencePiece
#   model, read by Megatron-LM's Llama2Tokenizer); PRINT_COMMAND=1 prints the command (each word quoted
#   for bash) instead of running it; extra flags after the script's name are appended.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NPROC=${NPROC:-4}
PP=${PP:-2}
EP=${EP:-2}
SCHEDULE=${SCHEDULE-chimera}
PRECISION=${PRECISION---bf16}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-$ROOT/data/build/tokenizer.model}
if [ -n "${PRINT_COMMAND:-}" ]; then
    LAUNCH=(printf '%q ')
elif [ "$NPROC" -gt 1 ]; then
    LAUNCH=(torchrun --nproc_per_node "$NPROC" --master_port "${MASTER_PORT:-29511}")
else
    LAUNCH=(python)
fi
PARALLEL_ARGS=(--pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP")
[ -n "$SCHEDULE" ] && PARALLEL_ARGS+=(--pipeline-schedule "$SCHEDULE")
[ -n "$PRECISION" ] && PARALLEL_ARGS+=("$PRECISION")
DATA_ARGS=(--tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL" --mock-data --split 99990,8,2)
cd "$ROOT"
