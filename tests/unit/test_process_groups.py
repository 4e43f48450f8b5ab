"""The process groups a run creates, in this process: their timeouts, and megatron-core's gloo groups. Each
test initialises megatron-core's parallel state again and puts the session's back (``parallel_state_restored``)."""
import torch
from megatron.core import parallel_state

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.parallel_dims import ParallelDims
from megatron.chimera.distributed.process_groups import setup_parallel
from megatron.chimera.testing.plans import plan_of

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def test_every_process_group_waits_as_long_as_the_flag_says(parallel_state_restored):
    """Groups do not inherit init_process_group's timeout (gloo's default is 30 min)."""
    args = parse_args([*MODEL, "--distributed-timeout-minutes", "0.5"], world_size=1)
    rt = setup_parallel(ParallelDims.from_args(args), plan_of(args), "gloo", torch.device("cpu"))
    groups = [*rt.p2p_groups.values(), *(g for g in rt.stage_groups.values() if g is not None),
              parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_data_parallel_group(),
              parallel_state.get_tensor_model_parallel_group(), parallel_state.get_model_parallel_group()]
    assert ([g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]
            == [30.0] * len(groups))


def test_megatron_core_makes_gloo_groups_unless_disable_gloo_process_groups(parallel_state_restored):
    """Megatron-LM's --disable-gloo-process-groups: megatron-core creates no gloo groups beside its others
    (nothing of ours uses them)."""
    for flags, created in ((["--disable-gloo-process-groups"], False), ([], True)):
        args = parse_args([*MODEL, *flags], world_size=1)
        setup_parallel(ParallelDims.from_args(args), plan_of(args), "gloo", torch.device("cpu"))
        assert (parallel_state._DATA_PARALLEL_GROUP_GLOO is not None) == created, f"{flags}: gloo group {not created}"
