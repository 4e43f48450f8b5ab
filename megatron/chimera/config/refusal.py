"""A refused configuration's one line reaches the user, printed once, whichever rank refuses first.

Every rank validates the same flags and refuses alike, and rank 0 prints the line. Under torchrun that is
not enough: its agent ends every rank as soon as one exits with an error, so a rank that refused before
rank 0 had printed would end rank 0 with the line unsaid. torchrun's ranks can all reach the agent's store
before any process group exists (``TORCHELASTIC_USE_AGENT_STORE``): rank 0 prints, then marks the store,
and every other rank waits for the mark before it exits. The wait is bounded: a rank that sees no mark
within ``RANK0_WAIT`` prints the line itself, so it is never lost. Launched some other way, the ranks exit
as they refuse, and rank 0 prints (nothing ends it early there).
"""
from __future__ import annotations

import itertools
import os
import sys
from datetime import timedelta

import torch.distributed as dist

RANK0_WAIT = timedelta(seconds=60)
_refusals = itertools.count()  # ranks refuse the same configurations in the same order (a launch of cases)


def say_once(line: str) -> None:
    """Print ``line`` on rank 0; on another rank, return once rank 0 has printed it (torchrun)."""
    rank, n = int(os.environ.get("RANK", "0")), next(_refusals)
    store = _agent_store()
    key = f"chimera/refusal/{n}"
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
        if store is not None:
            store.set(key, "said")
    elif store is not None:
        try:
            store.wait([key], RANK0_WAIT)
        except RuntimeError:  # rank 0 did not refuse, or is gone: the line must still be seen
            print(line, file=sys.stderr, flush=True)


def _agent_store() -> dist.TCPStore | None:
    """A client of torchrun's agent store, or None when not under torchrun (or it cannot be reached)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=RANK0_WAIT)
    except (RuntimeError, KeyError, ValueError):
        return None
