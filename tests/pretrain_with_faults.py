"""pretrain_gpt.py with the faults of ``fault_hooks.py`` injected through the hooks protocol; the tests
launch it in place of pretrain_gpt.py, with the same flags."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from fault_hooks import FaultInjection  # noqa: E402
from megatron.chimera import parse_args, pretrain  # noqa: E402
from pretrain_gpt import forward_step  # noqa: E402

if __name__ == "__main__":
    pretrain(parse_args(), forward_step, FaultInjection.from_environment())
