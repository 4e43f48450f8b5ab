"""Host staging (--p2p-host-staging: several ranks on one GPU, gloo through host memory): every staged
collective works on a host copy and writes its result back into the device tensor, synchronously or
at wait(). The copy is always made, so on this CPU-only machine two real ranks check the write-back:
a result that stayed in the host copy leaves the tensor's own values, and the test fails."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.chimera.distributed.ports import free_port
from megatron.chimera.distributed.process_groups import Runtime


def runtime(rank: int) -> Runtime:
    return Runtime(device=torch.device("cpu"), backend="gloo", rank=rank, world=2, tp=1, pp=1, dp=2, tp_rank=0,
                   dp_rank=rank, worker=0, comm_device=torch.device("cpu"))


def staged_collectives(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rt = runtime(rank)
    reduced = torch.full((4,), rank + 1.0)
    rt.all_reduce(reduced)  # 1 + 2 on both
    pending = torch.full((3,), 10.0 * (rank + 1))
    rt.all_reduce(pending, async_op=True).wait()  # 10 + 20
    flat = torch.arange(4.0) * (rank + 1)
    rt.reduce_scatter(flat[2 * rank:2 * rank + 2], flat, group=None).wait()  # this rank's half, summed
    full = torch.zeros(4)
    rt.all_gather(full, torch.full((2,), float(rank)), group=None)
    torch.save({"reduced": reduced, "pending": pending, "shard": flat[2 * rank:2 * rank + 2], "full": full},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_staged_all_reduce_writes_back(tmp_path):
    port = free_port()
    mp.start_processes(staged_collectives, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["reduced"], torch.full((4,), 3.0))
        assert torch.equal(got["pending"], torch.full((3,), 30.0))
        assert torch.equal(got["shard"], (torch.arange(4.0) * 3)[2 * rank:2 * rank + 2])
        assert torch.equal(got["full"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
