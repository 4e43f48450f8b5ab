"""Data: paths, split, tokenizer and the dataset builder's settings."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class DataSpec:
    """Data: paths, split, tokenizer and the dataset builder's settings."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataSpec:
        return cls()
