"""Host staging (--p2p-host-staging: several ranks on one GPU, gloo through host memory): the staged
all-reduce returns its result into the device tensor, synchronously or at wait(). On this CPU-only
machine the staging device is the CPU itself, so this checks the bookkeeping, not the copies."""
import torch

from megatron.chimera.distributed.process_groups import Runtime


def runtime(comm_device):
    return Runtime(device=torch.device("cpu"), backend="gloo", rank=0, world=1, tp=1, pp=1, dp=1, tp_rank=0,
                   dp_rank=0, worker=0, placement=((0,),), held=[(0, 0)], comm_device=comm_device)


def test_staged_all_reduce_writes_back(one_process_group):
    rt = runtime(torch.device("cpu"))
    t = torch.arange(4.0)
    rt.all_reduce(t)
    assert torch.equal(t, torch.arange(4.0))  # world of one: the sum is the tensor itself
    u = torch.ones(3)
    handle = rt.all_reduce(u, async_op=True)
    handle.wait()
    assert torch.equal(u, torch.ones(3))
