"""GPT's forward step and loss, as Megatron-LM's ``pretrain_gpt.py`` defines them.

With context parallelism each CP rank takes its part of every sequence as Megatron-LM's get_batch does
(megatron-core's ``get_batch_on_this_cp_rank``: 2 x CP chunks, rank i keeping chunks i and 2 x CP - 1 - i),
and its loss is the mean over its own tokens: gradients averaged over DP x CP then give the whole
sequence's mean (megatron-core's convention; the trainer's loss report sums every rank's tokens).

They live in the package rather than in ``pretrain_gpt.py`` so that the equivalence harness, the
probes and the benchmarks import the very functions users train with, from anywhere.
"""
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank

from . import schedule_plan


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses, the token count, and the report Megatron logs as 'lm loss'."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)  # megatron-core's schedules count tokens in an int tensor
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch through one model chunk. Middle stages get no data: their input is the
    previous stage's activation, set by the schedule through ``set_input_tensor``. With
    ``return_schedule_plan`` (--overlap-moe-expert-parallel-comm, as in Megatron-LM's) the chunk is not
    run: its schedule plan is returned in the output's place, which the executor runs in parts."""
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is not None and parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())
    embeds = model.pre_process or model.mtp_process  # MTP embeds the next tokens
    tokens = batch["tokens"] if embeds else None
    position_ids = batch["position_ids"] if embeds else None
    labels = batch["labels"] if model.post_process else None
    loss_mask = batch["loss_mask"] if model.post_process else None
    if return_schedule_plan:
        return schedule_plan.build(model, tokens, position_ids, None, labels=labels, loss_mask=loss_mask), \
            partial(loss_func, loss_mask)
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)  # MTP's loss reads the mask
    return output, partial(loss_func, loss_mask)
