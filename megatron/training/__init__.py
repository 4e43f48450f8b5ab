"""Our training program, beside megatron-core in the ``megatron`` namespace package."""
from .arguments import parse_args
from .training import Trainer, pretrain

__all__ = ["parse_args", "Trainer", "pretrain"]
