"""Reading back what a run wrote for its log series: TensorBoard event files (tensorboard's own
EventAccumulator) and a W&B offline run's history (its .wandb file: W&B's record log, LevelDB's log
format of 32 KiB blocks holding protobuf ``Record``s, which the wandb package writes but no longer reads)."""
from __future__ import annotations

import glob
import json
import os
import struct

BLOCK, HEADER = 32 * 1024, 7  # LevelDB log: checksum (4), length (2), type (1) before each fragment
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
FILE_HEADER = 7  # ':W&B', a magic number (2), a version (1)


def tensorboard_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] of every scalar in ``folder``'s event files."""
    # here: tensorboard is an optional package (the `test` extra)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _records(path: str):
    """The records of a .wandb file, whole (fragments joined)."""
    with open(path, "rb") as f:
        data = f.read()
    offset, pending = FILE_HEADER, b""
    while offset + HEADER <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < HEADER:  # the block's tail is padding
            offset += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4:offset + HEADER])
        fragment = data[offset + HEADER:offset + HEADER + length]
        offset += HEADER + length
        pending = fragment if kind in (FULL, FIRST) else pending + fragment
        if kind in (FULL, LAST):
            yield pending


def wandb_history(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value), ...] of what a W&B offline run under ``run_dir`` (wandb.init's dir) logged."""
    from wandb.proto import wandb_internal_pb2  # here: wandb is an optional package (the `wandb` extra)

    path, = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))
    history: dict[str, list[tuple[int, float]]] = {}
    for data in _records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.history.item}
            for key, value in values.items():
                if not key.startswith("_"):  # W&B's own: _step, _runtime, _timestamp
                    history.setdefault(key, []).append((values.get("_step", record.history.step.num), value))
    return history
