"""Chimera's placement of stage copies on workers, and which pipeline each micro-batch takes: shared by
Chimera's orders, DualPipe's (Chimera's placement with two pipelines) and the search.

With 2f pipelines, down pipeline j (index 2j) puts stage s on worker (s + j D/f) mod D and up pipeline
j (index 2j+1) on worker (D-1-s + j D/f) mod D. Micro-batches are split in equal contiguous blocks:
pipeline p gets p N/P .. (p+1) N/P - 1.
"""
from __future__ import annotations


def placement(depth: int, pipelines: int) -> tuple[tuple[int, ...], ...]:
    shift = depth // (pipelines // 2)
    rows = []
    for j in range(pipelines // 2):
        rows.append(tuple((s + j * shift) % depth for s in range(depth)))
        rows.append(tuple((depth - 1 - s + j * shift) % depth for s in range(depth)))
    return tuple(rows)


def v_placement(depth: int) -> tuple[tuple[int, ...], ...]:
    """One pipeline of 2D model stages folded into a V over D workers: worker i holds stage i and stage
    2D-1-i (DualPipeV's and the controllable-memory V schedules' placement)."""
    return (tuple(range(depth)) + tuple(reversed(range(depth))),)


def mb_pipelines(microbatches: int, pipelines: int) -> tuple[int, ...]:
    per = microbatches // pipelines
    return tuple(m // per for m in range(microbatches))
