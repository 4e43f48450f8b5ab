"""pretrain_gpt.py with the faults of ``fault_hooks.py`` injected through the hooks protocol; the tests
launch it in place of pretrain_gpt.py, with the same flags. ``CHIMERA_TEST_RANK0_LATE=SECONDS``: rank 0
starts parsing that much later than the others, so that another rank refuses a configuration first (the
race config/refusal.py closes)."""
import os
import time

from megatron.chimera import parse_args, pretrain
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.testing.fault_hooks import FaultInjection

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(float(os.environ.get("CHIMERA_TEST_RANK0_LATE", "0")))
    pretrain(parse_args(), forward_step, FaultInjection.from_environment())
