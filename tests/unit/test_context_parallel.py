"""Context parallelism's rules (one line naming the flag) and the CPU attention's bookkeeping: which
positions a CP rank holds, and the gathered keys put back in sequence order
(megatron/chimera/model/context_parallel.py)."""
from types import SimpleNamespace

import pytest
import torch
from megatron.core.utils import _get_batch_on_this_cp_rank_per_sequence_balancing

from chimera_schedules import ConfigError
from megatron.chimera.arguments import parse_args
from megatron.chimera.config.architecture_rules import context_parallel_attention
from megatron.chimera.model.context_parallel import chunk_positions, in_sequence_order

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-4",
        "--mock-data", "--vocab-size", "1000"]


@pytest.mark.parametrize("extra, world, line", [
    (["--context-parallel-size", "3"], 3,
     "--seq-length=32: must be a multiple of 2 x --context-parallel-size (6): the load-balanced split"),
    (["--context-parallel-size", "2"], 3, "--context-parallel-size=2: TP x CP x PP = 2 must divide the world size 3"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4,
     "--context-parallel-size=2: TP x CP x PP = 8 must divide the world size 4"),
    (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"], 4,
     "--hierarchical-context-parallel-sizes=[2, 3]: must multiply to --context-parallel-size (4)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2,
     "--cp-comm-type=a2a+p2p: a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (["--context-parallel-size", "2", "--mtp-num-layers", "1"], 2,
     "--mtp-num-layers=1: with --context-parallel-size is not supported yet"),
    (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], 2,
     "--cp-comm-type=allgather: is not one of Transformer Engine's types (p2p, all_gather, a2a, a2a+p2p)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"], 2,
     "--cp-comm-type=p2p a2a: gives one type for all layers or one per layer (4)"),
])
def test_bad_context_parallel_input_fails_in_one_line_naming_the_flag(capsys, extra, world, line):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + extra, world_size=world)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith(f"pretrain_gpt.py: error: {line}"), err
    assert len(err.splitlines()) == 1, err


def test_context_parallel_sizes_the_data_parallel_group():
    args = parse_args(BASE + ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--cp-comm-type", "all_gather"], world_size=8)
    assert (args.data_parallel_size, args.global_batch_size) == (2, 2), "DP is world / (TP x CP x PP)"


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_gathered_chunks_return_to_sequence_order_at_their_positions(cp):
    sequence = torch.arange(4 * 2 * cp).view(1, -1)  # [batch, sequence]: each token its position
    parts = []
    for rank in range(cp):  # each rank's part, as megatron-core's batch split cuts it (a one-rank group stand-in)
        group = type("Group", (), {"size": lambda self: cp, "rank": lambda self, r=rank: r})()
        torch_rank, torch_size = torch.distributed.get_rank, torch.distributed.get_world_size
        torch.distributed.get_rank, torch.distributed.get_world_size = lambda g: g.rank(), lambda g: g.size()
        try:
            part = _get_batch_on_this_cp_rank_per_sequence_balancing({"tokens": sequence}, group)["tokens"]
        finally:
            torch.distributed.get_rank, torch.distributed.get_world_size = torch_rank, torch_size
        assert part[0].tolist() == chunk_positions(rank, cp, 4).tolist(), f"rank {rank}'s positions"
        parts.append(part[0])
    gathered = torch.cat(parts)  # the all-gather's order: rank by rank
    assert in_sequence_order(gathered, cp).tolist() == sequence[0].tolist(), "gathered keys out of order"


def test_on_a_gpu_without_transformer_engine_context_parallelism_is_refused_in_one_line():
    args = SimpleNamespace(context_parallel_size=2, multi_latent_attention=False, window_size=None)
    with pytest.raises(ConfigError) as refused:
        context_parallel_attention(args, "cuda", te=False)
    assert refused.value.option == "--context-parallel-size" and "Transformer Engine" in refused.value.rule, \
        refused.value
    context_parallel_attention(args, "cpu", te=False)  # the CPU's gathered attention runs it
