"""How long a checkpoint save stops training: synchronous against --async-save, on the same checkpoint.

    python -m benchmarks.save_stall [ROUNDS]      # one process, the GPT below (about 180 MB saved): a minute or two

One process builds pretrain_gpt.py's Trainer for FLAGS and saves its state ROUNDS times each way, each time
into a fresh folder (all removed at the end), timed with Megatron-LM's 'save-checkpoint' timer (its lines
are printed): a synchronous save until it is published; an asynchronous one until its files are handed to
the writer. An asynchronous save stops training once more, when it is finalised at an iteration boundary
after its writer is done (megatron-core's metadata, our manifest from the digests the writer took, the
rename and the latest file): that is timed too, and counted in its total. Prints the median, min and max
of each over the rounds.
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace

from megatron.chimera.arguments import parse_args
from megatron.chimera.checkpoint.async_saves import async_saves
from megatron.chimera.checkpoint.checkpointing import save_checkpoint
from megatron.chimera.checkpoint.states import DataPosition
from megatron.chimera.config.job import job_config
from megatron.chimera.config.run_plan import make_run_plan
from megatron.chimera.loop import Trainer
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.observability.timing import print_times

FLAGS = ["--num-layers", "8", "--hidden-size", "384", "--num-attention-heads", "6", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-4",
         "--mock-data", "--vocab-size", "4096", "--eval-iters", "0", "--train-iters", "1", "--save-interval", "1",
         "--async-save", "--use-persistent-ckpt-worker"]


def timed_save(trainer, folder: str, saves=None) -> float:
    """Seconds one save of the trainer's state stopped training, as Megatron-LM's timer reports it."""
    spec = replace(trainer.job.checkpoint, save=folder)
    position = DataPosition.after(1, trainer.job.data.global_batch_size)
    timer = trainer.timers("save-checkpoint", log_level=0)
    timer.start(barrier=False)
    save_checkpoint(trainer.states(), position, spec, trainer.rt, trainer.job.megatron_args, saves=saves)
    timer.stop(barrier=False)
    seconds = timer.elapsed(reset=False)
    print_times(trainer.timers, ("save-checkpoint",))
    return seconds


def finalisation(saves) -> float:
    """Seconds the finalisation stops training: the iteration-boundary check that finds the writer done."""
    while True:
        start = time.perf_counter()
        if saves.maybe_finalize_async_calls(blocking=False):
            return time.perf_counter() - start
        time.sleep(0.05)


def spread(name: str, values: list[float]) -> None:
    ms = [v * 1000 for v in values]
    print(f"{name:>34}: median {statistics.median(ms):8.1f} ms  (min {min(ms):.1f}, max {max(ms):.1f}, "
          f"{len(ms)} rounds)", flush=True)


def main(rounds: int) -> None:
    root = tempfile.mkdtemp(prefix="save-stall-")
    args = parse_args(FLAGS + ["--save", root], world_size=1)
    job = job_config(args)
    trainer = Trainer(job, make_run_plan(job.pipeline, job.parallel), forward_step)
    sync, scheduled, finalised = [], [], []
    for r in range(rounds):
        sync.append(timed_save(trainer, f"{root}/sync{r}"))
        saves = async_saves()
        scheduled.append(timed_save(trainer, f"{root}/async{r}", saves))
        finalised.append(finalisation(saves))
        saves.close()
    spread("synchronous save", sync)
    spread("async: until handed to the writer", scheduled)
    spread("async: finalisation", finalised)
    spread("async: both", [a + b for a, b in zip(scheduled, finalised)])
    trainer.close()
    shutil.rmtree(root)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
