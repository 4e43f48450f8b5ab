"""Issue 42's flags in one process: megatron-core's global auxiliary loss (its running token counts restart
every iteration, as Megatron-LM's finalize_model_grads restarts them; the startup line where pipelines split
them), the expert bias of stages holding different numbers of MoE layers under tensor parallelism, and
--check-weight-hash-across-dp-replicas-interval's check of a rank's copies of a stage."""
from types import SimpleNamespace

import pytest
import torch

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.distributed.weight_hashes import WeightHashMismatch, check_weight_hashes
from megatron.chimera.model.chunk import build_chunk
from megatron.chimera.model.moe import update_expert_bias
from megatron.chimera.observability.hooks import Hooks
from megatron.chimera.observability.startup import print_global_aux_loss
from megatron.chimera.testing.one_step import one_process_trainer

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--eval-iters", "0", "--num-workers", "0"]
GLOBAL_AUX = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8", "--disable-bias-linear",
              "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "1e-2"]


def trainer(flags: list[str], hooks: Hooks = Hooks()):
    return one_process_trainer(TINY + flags, hooks)


def routers(t) -> list:
    return [m for m in t.models[0].modules() if getattr(m, "ga_steps", None) is not None]


class _Counts(Hooks):
    """Each router's count of micro-batches when the flush has ended, before the trainer restarts them."""

    def __init__(self):
        self.steps = []

    def after_backward(self, trainer, iteration: int) -> None:
        self.steps.append([int(r.ga_steps) for r in routers(trainer)])


def test_global_aux_loss_counts_run_over_the_iteration_and_restart(parallel_state_restored):
    counts = _Counts()
    with trainer(GLOBAL_AUX, counts) as t:
        stats = t.train_step(0)
        assert counts.steps == [[2, 2]], f"micro-batches each router counted in the iteration: {counts.steps}"
        assert all(int(r.ga_steps) == 0 and not r.global_tokens_per_expert.any() for r in routers(t)), \
            "the routers' running counts were not restarted after the iteration"
    assert stats["moe"]["global_load_balancing_loss"] > 0, stats["moe"]


@pytest.mark.parametrize("pipelines", [1, 2])
def test_global_aux_loss_says_once_where_pipelines_split_the_counts(parallel_state_restored, capsys, pipelines):
    spec = ModelSpec.from_args(parse_args(TINY + GLOBAL_AUX, world_size=1))
    print_global_aux_loss(spec, SimpleNamespace(pipelines=pipelines))
    out = capsys.readouterr().out
    assert out.count("global_aux_loss over 2 pipelines") == (pipelines == 2), out


def test_weight_hashes_name_a_ranks_differing_copies_of_a_stage(parallel_state_restored, capsys):
    """A rank holding two copies of one stage (more than two pipelines): equal they pass, with Megatron-LM's
    line; one weight apart, one line names the stage, the rank and the first parameter that differs."""
    with trainer([]) as t:
        t.check_weight_hashes(2)
        assert ">>> Weight hashes match after 2 iterations..." in capsys.readouterr().out
        twin = build_chunk(t.job.model, t.plan, 0, t.rt.device)  # drawn from the same seed, by name
        chunks = {(0, 0): t.models[0], (1, 0): twin}
        check_weight_hashes(chunks, t.rt, 2)
        with torch.no_grad():
            twin.decoder.layers[1].mlp.linear_fc2.weight.view(-1)[0] += 1e-3
        with pytest.raises(WeightHashMismatch) as raised:
            check_weight_hashes(chunks, t.rt, 2)
    assert str(raised.value) == ("weight hashes differ after 2 iterations: stage 0 (tensor-parallel rank 0): the "
                                 "copies rank 0 holds differ from each other (first in "
                                 "decoder.layers.1.mlp.linear_fc2.weight)")


class _Router(torch.nn.Module):
    """What update_expert_bias reads of megatron-core's router: its token counts and expert bias."""

    def __init__(self, counts: list[float]):
        super().__init__()
        self.local_tokens_per_expert = torch.tensor(counts)
        self.expert_bias = torch.zeros(len(counts))


def test_expert_bias_steps_stages_with_different_numbers_of_moe_layers_under_tensor_parallelism(
        parallel_state_restored):
    """The counts of every stage are all-reduced over TP in one tensor: stage 0 (a dense first layer) holds
    fewer MoE layers than stage 1, as the DeepSeek-style layout at D=2 has."""
    chunks = {(0, 0): torch.nn.Sequential(*[_Router([3.0, 1.0]) for _ in range(3)]),
              (0, 1): torch.nn.Sequential(*[_Router([1.0, 3.0]) for _ in range(4)])}
    reduced = []
    rt = SimpleNamespace(tp=2, stage_groups={}, all_reduce=lambda t, group=None: reduced.append(t.shape))
    update_expert_bias(chunks, rt, 0.5)
    assert reduced == [torch.Size([7, 2])], f"all-reduced over TP: {reduced}"
    assert [r.expert_bias.tolist() for r in chunks[(0, 0)]] == [[-0.5, 0.5]] * 3
    assert [r.expert_bias.tolist() for r in chunks[(0, 1)]] == [[0.5, -0.5]] * 4
