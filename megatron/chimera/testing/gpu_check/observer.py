"""What one launched rank records for gpu_check, through the hooks protocol (observability/hooks.py), so
the loop itself holds no check logic. scripts/gpu_check_pretrain.py attaches it.

Environment:
- GPU_CHECK_REPORT: a path containing "{rank}"; the rank writes its report there as JSON.
- GPU_CHECK_SYNC: "error" (a host synchronisation inside forward_backward raises), "warn" (each one is
  noted with its call site, so that a host-staged run can tell its staging copies, synchronous by
  design, from any other), or "off". From iteration 2: iteration 1 compiles megatron-core's fused
  kernels (torch.compile, which synchronises while it compiles, once).
- GPU_CHECK_ACTIONS=1: memory after every action of our executor, and the executor's action clock (CUDA
  events on a GPU), which an observer of actions turns on.
- NCCL_DEBUG_FILE (with NCCL_DEBUG=INFO): the NCCL log of this process; the communicators NCCL reports
  initialised are counted before iteration 1 and at the end.

The report: ``memory`` [point, max_memory_allocated, memory_allocated] at each hook; ``actions``
[iteration, action, memory (CUDA: allocated; CPU: the bytes the executor holds), held bytes];
``clock`` [iteration, action, start, end] (seconds) and ``iteration_seconds`` (host wall time of each
forward_backward); ``syncs`` {call site: count} and ``forward_backward_error``; ``nccl_inits``
{"before iteration 1": n, "end": n}; ``host``, the node the rank ran on.
"""
from __future__ import annotations

import glob
import json
import os
import socket
import time
import traceback
import warnings

import torch

from megatron.chimera import Hooks

STAGING = {"process_groups.py": None, "messages.py": {"send", "take"}}  # file -> functions (None: any)
# where a sync's call site is not: the standard library (warnings' own frames), torch, installed packages
_LIBRARIES = tuple(os.path.dirname(m.__file__) for m in (os, torch))


def _staging(frame) -> bool:
    functions = STAGING.get(os.path.basename(frame.filename), ())
    return functions is None or frame.name in functions


class CheckObserver(Hooks):
    def __init__(self, sync: str, actions: bool):
        self.sync = sync if torch.cuda.is_available() else "off"
        self.actions = actions
        self.report = {"memory": [], "actions": [], "clock": [], "iteration_seconds": [], "syncs": {},
                       "explicit_waits": {}, "forward_backward_error": None, "nccl_inits": {},
                       "host": socket.gethostname()}
        self.wrapped, self.originals, self.iteration, self.started = False, {}, None, 0.0
        self._warnings = None

    def observes_actions(self) -> bool:
        return self.actions

    def before_iteration(self, trainer, iteration):
        if not self.wrapped:
            trainer.forward_backward = self._recording(trainer.forward_backward)
            self.wrapped = True
            self.count_nccl_inits("before iteration 1")
        self.record_memory(f"before iteration {iteration}")
        self.iteration, self.started = iteration, time.perf_counter()
        self.watch_syncs(iteration > 1)

    def after_backward(self, trainer, iteration):
        if iteration > 1:
            self.watch_syncs(False)
        self.report["iteration_seconds"].append([iteration, time.perf_counter() - self.started])
        self.record_memory(f"after backward {iteration}")
        self.iteration = None  # evaluation's actions are not an iteration's

    def after_action(self, action, held) -> None:
        if self.iteration is None:
            return
        tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                   for group in held().values() for t in group if t is not None}
        held_bytes = sum(tensors.values())
        now = torch.cuda.memory_allocated() if torch.cuda.is_available() else held_bytes
        self.report["actions"].append([self.iteration, str(action), now, held_bytes])

    def on_action(self, action, start: float, end: float) -> None:
        if self.iteration is not None:
            self.report["clock"].append([self.iteration, str(action), start, end])

    def watch_syncs(self, on: bool) -> None:
        """Sync-debug mode while ``on``. Neither mode sees explicit waits (c10's device_synchronize and
        CUDAEvent::synchronize skip the check), so torch.cuda.synchronize and Event.synchronize are noted
        with their call sites meanwhile."""
        if self.sync == "off":
            return
        torch.cuda.set_sync_debug_mode(self.sync if on else "default")
        if self.sync == "warn":
            self._catch_sync_warnings(on)
        for key, owner, name in (("torch.cuda.synchronize", torch.cuda, "synchronize"),
                                 ("torch.cuda.Event.synchronize", torch.cuda.Event, "synchronize")):
            if on:
                self.originals[key] = getattr(owner, name)
                setattr(owner, name, self._noting(key, self.originals[key]))
            elif key in self.originals:
                setattr(owner, name, self.originals.pop(key))

    def _catch_sync_warnings(self, on: bool) -> None:
        if on:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._sync_warned
        elif self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None

    def _sync_warned(self, message, category, filename, lineno, file=None, line=None):
        """A synchronizing CUDA operation: noted as "staging" when a host-staging copy made it (by design),
        else by its innermost frame in this repository."""
        if "synchronizing CUDA operation" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        staged = any(_staging(f) for f in stack)
        ours = [f for f in stack if not f.filename.startswith(_LIBRARIES) and not f.filename.endswith("observer.py")]
        frame = (ours or stack)[-1]
        where = ("staging: " if staged else "") + f"{frame.filename}:{frame.lineno} in {frame.name}"
        self.report["syncs"][where] = self.report["syncs"].get(where, 0) + 1

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

    def count_nccl_inits(self, point: str) -> None:
        """NCCL's "Init COMPLETE" lines in this process's NCCL log: one per communicator it created."""
        pattern = os.environ.get("NCCL_DEBUG_FILE")
        if not pattern:
            return
        path = pattern.replace("%p", str(os.getpid())).replace("%h", "*")
        lines = [line for f in glob.glob(path) for line in open(f, errors="replace") if "Init COMPLETE" in line]
        self.report["nccl_inits"][point] = len(lines)

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

    def finish(self) -> None:
        self.record_memory("end")
        self.count_nccl_inits("end")
        self.write()

    def write(self) -> None:
        rank = os.environ.get("RANK", "0")
        with open(os.environ["GPU_CHECK_REPORT"].format(rank=rank), "w") as f:
            json.dump(self.report, f, indent=1)
