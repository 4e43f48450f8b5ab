"""pretrain_gpt.py with gpu_check's observer attached through the hooks protocol
(megatron/chimera/testing/gpu_check/observer.py says what it records and which environment variables
steer it); gpu_check.py launches it in place of pretrain_gpt.py, with the same flags, so the loop itself
holds no check logic."""
import os

from megatron.chimera import parse_args, pretrain
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.testing.gpu_check.observer import CheckObserver

if __name__ == "__main__":
    observer = CheckObserver(os.environ.get("GPU_CHECK_SYNC", "off"), os.environ.get("GPU_CHECK_ACTIONS") == "1")
    pretrain(parse_args(), forward_step, observer)
    observer.finish()
