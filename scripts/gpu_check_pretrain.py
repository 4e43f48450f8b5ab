"""pretrain_gpt.py with gpu_check.py's observer attached through the hooks protocol
(megatron/chimera/observability/hooks.py); gpu_check.py launches it in place of pretrain_gpt.py, with
the same flags, so the loop itself holds no check logic.

Environment:
- GPU_CHECK_REPORT: a path containing "{rank}"; each rank writes its report there as JSON.
- GPU_CHECK_SYNC_DEBUG=1: torch.cuda.set_sync_debug_mode("error") from before_iteration to
  after_backward, so a host synchronisation inside forward_backward raises; explicit waits, which
  that mode does not see, are noted instead (``watch_syncs``).
The report holds ``memory``: [point, torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()]
at every hook and at the end (empty without CUDA); ``forward_backward_error``: where a raise inside
forward_backward came from (a sync in sync-debug mode, or any other), or null; ``explicit_waits``:
"torch.cuda.synchronize at FILE:LINE in FUNCTION" (or Event.synchronize) -> calls, in sync-debug mode.
"""
import json
import os
import traceback

import torch

from megatron.chimera import Hooks, parse_args, pretrain
from megatron.chimera.model.gpt_step import forward_step


class CheckObserver(Hooks):
    def __init__(self, sync_debug: bool):
        self.sync_debug = sync_debug and torch.cuda.is_available()
        self.report = {"memory": [], "forward_backward_error": None, "explicit_waits": {}}
        self.wrapped, self.originals = False, {}

    def before_iteration(self, trainer, iteration):
        if not self.wrapped:
            trainer.forward_backward = self._recording(trainer.forward_backward)
            self.wrapped = True
        self.record_memory(f"before iteration {iteration}")
        self.watch_syncs(True)

    def after_backward(self, trainer, iteration):
        self.watch_syncs(False)
        self.record_memory(f"after backward {iteration}")

    def watch_syncs(self, on: bool) -> None:
        """Sync-debug mode "error" while ``on``. That mode does not see explicit waits (c10's
        device_synchronize and CUDAEvent::synchronize skip its check), so meanwhile
        torch.cuda.synchronize and torch.cuda.Event.synchronize also note where they were called from."""
        if not self.sync_debug:
            return
        torch.cuda.set_sync_debug_mode("error" if on else "default")
        for key, owner, name in (("torch.cuda.synchronize", torch.cuda, "synchronize"),
                                 ("torch.cuda.Event.synchronize", torch.cuda.Event, "synchronize")):
            if on:
                self.originals[key] = getattr(owner, name)
                setattr(owner, name, self._noting(key, self.originals[key]))
            elif key in self.originals:
                setattr(owner, name, self.originals.pop(key))

    def _noting(self, key: str, wait):
        def noted(*args, **kwargs):
            frame = traceback.extract_stack(limit=2)[0]
            where = f"{key} at {frame.filename}:{frame.lineno} in {frame.name}"
            self.report["explicit_waits"][where] = self.report["explicit_waits"].get(where, 0) + 1
            return wait(*args, **kwargs)
        return noted

    def record_memory(self, point: str) -> None:
        """The peak so far and what is allocated now. The caching allocator books memory on the host as
        tensors are created, so reading it needs no synchronisation and counts kernels still queued."""
        if torch.cuda.is_available():
            self.report["memory"].append([point, torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()])

    def _recording(self, forward_backward):
        """The hooks protocol has no hook for a raise, and pretrain turns one into a single line and
        os._exit: so the observer wraps the trainer's forward_backward to write down where it came from
        (the innermost frame and the exception's line) before it propagates."""
        def observed(**kwargs):
            try:
                return forward_backward(**kwargs)
            except Exception as e:
                self.watch_syncs(False)
                frame = traceback.extract_tb(e.__traceback__)[-1]
                self.report["forward_backward_error"] = {
                    "last_line": traceback.format_exception_only(e)[-1].strip(),
                    "where": f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"}
                self.write()
                raise
        return observed

    def write(self) -> None:
        rank = os.environ.get("RANK", "0")
        with open(os.environ["GPU_CHECK_REPORT"].format(rank=rank), "w") as f:
            json.dump(self.report, f, indent=1)


if __name__ == "__main__":
    observer = CheckObserver(os.environ.get("GPU_CHECK_SYNC_DEBUG") == "1")
    pretrain(parse_args(), forward_step, observer)
    observer.record_memory("end")
    observer.write()
