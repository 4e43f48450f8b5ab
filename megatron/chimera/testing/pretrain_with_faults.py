"""pretrain_gpt.py with the faults of ``fault_hooks.py`` injected through the hooks protocol; the tests
launch it in place of pretrain_gpt.py, with the same flags."""


from megatron.chimera import parse_args, pretrain
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.testing.fault_hooks import FaultInjection

if __name__ == "__main__":
    pretrain(parse_args(), forward_step, FaultInjection.from_environment())
