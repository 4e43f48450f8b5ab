"""A micro-batch run as the first and the second half of its sequence, so that at micro-batch size 1 (or
any odd size) its two halves still hide each other's expert all-to-all (``runtime/stage.py``'s SEQUENCE
split; docs/moe.md says why this split and not token chunks inside the MoE layers).

Causal attention makes the cut one-sided. The first half's tokens attend to the first half only: it runs
as a sequence of its own. The second half's queries attend to the first half's keys and values and to
their own. Everything else a layer computes is per token (norms, MLPs, experts, the loss), so the two
halves compute what the whole does. What a router computes per sequence or per micro-batch is not per
token, and the split is off with it (config/schedule_request.py's ``sequence_split_refusal``).

``SequenceHalves.install(model)`` hooks the model chunk's core attentions (megatron-core's local
``DotProductAttention``) and rotary embeddings; the halves' driver (model/schedule_plan.py) says which half
runs (``running``):
- in the first half each core attention keeps its keys and values, and a rotary embedding notes the
  half's length;
- in the second, each core attention attends to the first half's keys and values, as leaves, then its
  own, under the causal mask shifted by the first half's length (its softmax told to apply the mask given,
  fused or not); rotary embeddings start at that position, YaRN's cached cos and sin too;
- ``take_prefixes`` hands the driver each (first half's tensor, the second half's leaf of it). The leaf's
  gradient, which the second half's backward computes, enters the first half's attention node as one more
  output gradient (megatron-core's ``TransformerLayerNode.detach`` protocol), so the second half's backward
  of a layer runs before the first's.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SequenceHalves:
    """What the two halves of one sequence share through one model chunk while they run."""

    def __init__(self):
        self.running: int | None = None  # 0 or 1 while a half runs, None for a whole micro-batch
        self.first_length = 0  # tokens in the first half: the second half's first position
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by core attention: the first half's K, V
        self.prefixes: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.masks: dict[tuple, torch.Tensor] = {}

    @classmethod
    def install(cls, model: torch.nn.Module) -> SequenceHalves:
        """Hooks ``model``'s core attentions and rotary embeddings; the model's ``sequence_halves`` is the
        state they share, which the driver finds there."""
        halves = cls()
        for module in model.modules():
            if isinstance(module, DotProductAttention):
                module.forward = partial(halves._attend, module, module.forward)
            elif isinstance(module, RotaryEmbedding):
                module.forward = partial(halves._rotary, module.forward)
                if hasattr(module, "get_cached_cos_sin"):  # YaRN's, which MLA's fused rope reads
                    module.get_cached_cos_sin = partial(halves._cached_cos_sin, module.get_cached_cos_sin)
        model.sequence_halves = halves
        return halves

    @contextmanager
    def half(self, k: int):
        """Half ``k``'s parts run inside."""
        self.running = k
        try:
            yield
        finally:
            self.running = None

    def take_prefixes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (first half's key or value, the second half's leaf of it) pairs made since the last call."""
        taken, self.prefixes = self.prefixes, []
        return taken

    def _rotary(self, forward, max_seq_len: int, offset: int = 0, *args, **kwargs):
        if self.running == 0:
            self.first_length = max_seq_len
        elif self.running == 1:
            offset += self.first_length
        return forward(max_seq_len, offset, *args, **kwargs)

    def _cached_cos_sin(self, get, seq_len: int, offset: int = 0, *args, **kwargs):
        """YaRN's cached cos and sin (multi-latent attention with rope fusion reads them, not ``forward``), from
        the second half's first position; the ``forward`` a cache miss calls takes that offset as given."""
        if self.running is None:
            return get(seq_len, offset, *args, **kwargs)
        if self.running == 0:
            self.first_length = seq_len
        else:
            offset += self.first_length
        running, self.running = self.running, None
        try:
            return get(seq_len, offset, *args, **kwargs)
        finally:
            self.running = running

    def _attend(self, module, forward, query, key, value, attention_mask, *args, **kwargs):
        if self.running is None:
            return forward(query, key, value, attention_mask, *args, **kwargs)
        assert attention_mask is None, "a sequence in halves runs causal attention without a given mask"
        if self.running == 0:
            self.kept[id(module)] = (key, value)
            return forward(query, key, value, None, *args, **kwargs)
        first = self.kept.pop(id(module))
        leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in first)
        self.prefixes += zip(first, leaves)
        key, value = torch.cat([leaves[0], key]), torch.cat([leaves[1], value])
        mask = self._shifted_causal_mask(query.size(0), key.size(0), key.device)
        with _given_mask(module):
            return forward(query, key, value, mask, *args, **kwargs)

    def _shifted_causal_mask(self, queries: int, keys: int, device: torch.device) -> torch.Tensor:
        """[1, 1, queries, keys] boolean, True where a key lies after the query (megatron-core's convention:
        masked positions are True), the queries being the last ``queries`` positions of ``keys``."""
        shape = (queries, keys, device)
        if shape not in self.masks:
            positions = torch.arange(keys - queries, keys)
            self.masks[shape] = (torch.arange(keys)[None, :] > positions[:, None]).to(device)[None, None]
        return self.masks[shape]


@contextmanager
def _given_mask(module):
    """The core attention's softmax applies the mask it is given (megatron-core's padding type) instead of
    its causal one: the fused kernel's causal path assumes as many keys as queries and builds its own
    upper-triangular mask, which the second half's shifted mask is not."""
    softmax = module.scale_mask_softmax
    kept, softmax.attn_mask_type = softmax.attn_mask_type, AttnMaskType.padding
    try:
        yield
    finally:
        softmax.attn_mask_type = kept
