import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def one_process_group():
    """A one-process gloo group with megatron-core's parallel state and the CPU layer, for tests that
    build megatron-core models inside the test process."""
    from megatron.core import parallel_state
    from megatron.training import cpu_compat

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cpu_compat.apply()
    cpu_compat.apply()  # idempotent
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
