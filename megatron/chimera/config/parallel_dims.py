"""The parallel dimensions (TP, PP, DP, EP, ...), the backend and the groups' rank lists."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """The parallel dimensions (TP, PP, DP, EP, ...), the backend and the groups' rank lists."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelDims:
        return cls()
