"""Context parallelism's attention where Transformer Engine is not: megatron-core's local attention over
keys and values all-gathered from the context-parallel ranks.

megatron-core runs a sequence split over CP ranks in Transformer Engine's attention only (its local
``DotProductAttention`` refuses CP > 1). Each CP rank holds 2 of the sequence's 2 x CP chunks, i and
2 x CP - 1 - i (Megatron-LM's load-balanced split, model/gpt_step.py). Here every rank gathers the keys and
values of the whole sequence, puts them back in sequence order, and attends its own queries to them under
the causal mask of its chunks' positions: what Transformer Engine's ``all_gather`` CP type computes, and
what its ring (p2p) and all-to-all types compute too, in other steps. The gather is megatron-core's
sequence-parallel one on the CP group, whose backward reduce-scatters: each rank's keys and values get the
gradient every rank's queries gave them. Every --cp-comm-type therefore runs this on the CPU.
"""
from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def chunk_positions(rank: int, cp: int, chunk: int) -> torch.Tensor:
    """The sequence positions a CP rank holds under the load-balanced split: chunks ``rank`` and
    ``2 cp - 1 - rank``, of ``chunk`` tokens each."""
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in (rank, 2 * cp - 1 - rank)])


def in_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """Keys or values gathered over the CP ranks (rank r's chunks r and 2 cp - 1 - r, one after the other,
    along the first dimension) reordered into the sequence's order."""
    chunks = gathered.chunk(2 * cp, dim=0)  # rank r's two chunks are chunks[2 r] and chunks[2 r + 1]
    first = [chunks[2 * r] for r in range(cp)]
    second = [chunks[2 * r + 1] for r in reversed(range(cp))]
    return torch.cat(first + second, dim=0)


class GatheredKeyValueAttention(DotProductAttention):
    """megatron-core's local attention of this rank's queries over the whole sequence's keys and values."""

    def __init__(self, config, *args, **kwargs):
        # the parent refuses CP > 1; it attends whatever keys it is given, here the whole sequence's
        whole = copy.copy(config)
        whole.context_parallel_size = 1
        super().__init__(whole, *args, **kwargs)
        self.cp = config.context_parallel_size
        self.cp_group = parallel_state.get_context_parallel_group()
        self.masks: dict[tuple, torch.Tensor] = {}

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_mask is None, "context parallelism on the CPU runs causal attention without a given mask"
        key, value = (in_sequence_order(gather_from_sequence_parallel_region(t, True, self.cp_group), self.cp)
                      for t in (key, value))
        mask = self._causal_mask(query.size(0), key.device) if self.attn_mask_type == AttnMaskType.causal else None
        return super().forward(query, key, value, mask, attn_mask_type, attention_bias, packed_seq_params)

    def _causal_mask(self, local: int, device: torch.device) -> torch.Tensor:
        """[1, 1, local, whole] boolean, True where a key lies after the query (megatron-core's mask
        convention: masked positions are True)."""
        key = (local, device)
        if key not in self.masks:
            rank = parallel_state.get_context_parallel_rank()
            queries = chunk_positions(rank, self.cp, local // 2)
            keys = torch.arange(local * self.cp)
            self.masks[key] = (keys[None, :] > queries[:, None]).to(device)[None, None]
        return self.masks[key]
