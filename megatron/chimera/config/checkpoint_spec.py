"""Checkpointing: where and when to save and load, and in which format."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointSpec:
    """Checkpointing: where and when to save and load, and in which format."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckpointSpec:
        return cls()
