"""cpu_compat's gather and reduce-scatter of parts of different sizes, run on gloo by two processes as
megatron-core's alltoall dispatcher runs them (expert parallelism with expert tensor parallelism): the
gather's forward and its backward. Prints one JSON object per rank: whether each matched.

    torchrun --nproc_per_node 2 -m megatron.chimera.testing.uneven_collectives_probe
"""
import json

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron.chimera.model import cpu_compat


def main():
    dist.init_process_group("gloo")
    cpu_compat.apply()
    rank, sizes = dist.get_rank(), [2, 3]
    parts = [torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + 100 * r for r, n in enumerate(sizes)]
    mine = parts[rank].clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(mine, group=dist.group.WORLD, output_split_sizes=sizes)
    weights = torch.arange(sum(sizes) * 4, dtype=torch.float32).reshape(-1, 4) * (rank + 1)
    (gathered * weights).sum().backward()  # each rank's gradient of the whole: weights x (rank + 1)
    start = sum(sizes[:rank])
    expected_grad = torch.arange(sum(sizes) * 4, dtype=torch.float32).reshape(-1, 4)[start:start + sizes[rank]] * 3
    print(json.dumps({"rank": rank, "gathered": torch.equal(gathered.detach(), torch.cat(parts)),
                      "reduce_scattered": torch.equal(mine.grad, expected_grad)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
