"""--async-save: torch_dist files written in the background while training goes on, through megatron-core's
queue of asynchronous saves (``AsyncCallsQueue``), as Megatron-LM's megatron/training/async_utils.py keeps
it: a save plans its files and hands them to a writer process, then returns; the queue finalises a save
(every rank's writer done, megatron-core's metadata, then our manifest, rename and ``latest`` file) when
asked, at an iteration boundary once the writers are done, or blocking before the next save and before
the run ends. So the ``latest`` file names a save only once it is whole.

The writer is megatron-core's worker forked for each save (``TemporalAsyncCaller``): on a GPU it forks
once the tensors are copied to host memory; on the CPU the fork's copy-on-write pages hold them as they
were. Megatron-LM's persistent worker (--use-persistent-ckpt-worker, which its validate_args requires for
--async-save) is megatron-core's other caller, which sets a CUDA device and so cannot run on the CPU; both
write the same files, and the fork is the one path run on both.
"""
from __future__ import annotations

import os
import pickle
import queue

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from .format import digest


def async_saves() -> AsyncCallsQueue:
    """An empty queue of asynchronous saves, for one run (``pretrain``)."""
    return AsyncCallsQueue(persistent=False)


class WriteResults:
    """Where megatron-core's file writer leaves its results for the save's finalisation: ``put`` by the
    writer (in a forked process for an asynchronous save, in this one for a synchronous one), taken by
    ``get_nowait`` when the save is finalised, in a file at ``path``. megatron-core's own is a queue served
    by a Manager process, which re-imports the launch script (spawned) or, forked, outlives a killed rank
    holding its output open; a pipe would block a writer whose results outgrow it until they are read,
    which is only after the writer exits. A file does neither. The writer also takes the digests of the
    files it wrote (``digests`` once taken), so the manifest costs the training process no reading."""

    def __init__(self, path: str):
        self.path, self.digests = path, {}

    def put(self, results) -> None:
        folder = os.path.dirname(self.path)
        written = set() if isinstance(results, Exception) else {
            r.storage_data.relative_path for rs in results.values() for r in rs}
        with open(self.path + ".tmp", "wb") as f:
            pickle.dump((results, {name: digest(os.path.join(folder, name)) for name in written}), f)
        os.replace(self.path + ".tmp", self.path)

    def get_nowait(self):
        try:
            with open(self.path, "rb") as f:
                results, self.digests = pickle.load(f)  # written by this rank's own writer, above
        except FileNotFoundError:
            raise queue.Empty from None
        os.remove(self.path)
        return results
