"""Training: batches, iterations, learning rate schedule, optimizer, precision, evaluation and exit policy."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSpec:
    """Training: batches, iterations, learning rate schedule, optimizer, precision, evaluation and exit policy."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainSpec:
        return cls()
