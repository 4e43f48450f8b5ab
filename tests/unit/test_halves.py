"""A micro-batch run as two halves (a ``Halved`` action): the split of its data, and what megatron-core keeps
per process that the halves make the whole micro-batch's (model/schedule_plan.py). Their exactness on a
model is the equivalence harness's (its halves cases)."""
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from chimera_schedules.ir.actions import BATCH, SEQUENCE
from chimera_schedules.runtime.stage import _whole, split_data
from megatron.chimera.model.schedule_plan import _aux_losses_at, _tracked_as_mean
from megatron.chimera.model.sequence_halves import SequenceHalves


def test_a_micro_batch_splits_along_its_batch_dimension_key_by_key():
    batch = {"tokens": torch.arange(8).view(4, 2), "loss_mask": torch.ones(4, 2), "attention_mask": None}
    first, second = split_data(batch, BATCH.data_dim)
    assert torch.equal(first["tokens"], batch["tokens"][:2]) and torch.equal(second["tokens"], batch["tokens"][2:])
    assert first["loss_mask"].shape == (2, 2) and first["attention_mask"] is None and second["attention_mask"] is None
    assert split_data(None, BATCH.data_dim) == (None, None), "a stage without data gives its halves none"


def test_a_sequence_splits_into_its_first_and_second_half_of_tokens():
    batch = {"tokens": torch.arange(8).view(1, 8), "position_ids": torch.arange(8).view(1, 8)}
    first, second = split_data(batch, SEQUENCE.data_dim)
    assert first["tokens"].tolist() == [[0, 1, 2, 3]] and second["position_ids"].tolist() == [[4, 5, 6, 7]], \
        "the second half keeps its own positions"


def test_a_last_stages_loss_is_the_whole_micro_batchs():
    """megatron-core's loss_func conventions: a sum over tokens with its count and report adds up; a
    mean over the micro-batch is the mean of its equal halves'."""
    first = (torch.tensor(3.0), torch.tensor(4), {"lm loss": torch.tensor([3.0, 4.0])})
    second = (torch.tensor(5.0), torch.tensor(4), {"lm loss": torch.tensor([5.0, 4.0])})
    loss, tokens, report = _whole(first, second, SEQUENCE)
    assert (float(loss), int(tokens), report["lm loss"].tolist()) == (8.0, 8, [8.0, 8.0]), "the halves' sums"
    means = [(torch.tensor(v), {"loss": torch.tensor(v)}) for v in (1.0, 3.0)]
    loss, report = _whole(*means, BATCH)
    assert (float(loss), float(report["loss"])) == (2.0, 2.0), "the halves' mean"
    with pytest.raises(AssertionError, match="along its sequence"):
        _whole(*means, SEQUENCE)  # a sequence's halves may count unequal tokens: their means do not average


def test_the_halves_backward_takes_the_auxiliary_losses_at_half_their_scale_and_restores_it(monkeypatch):
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.tensor(0.25))  # a trainer's
    with _aux_losses_at(0.5):
        inside = float(MoEAuxLossAutoScaler.main_loss_backward_scale)
    assert (inside, float(MoEAuxLossAutoScaler.main_loss_backward_scale)) == (0.125, 0.25), \
        "the scale inside the halves' backward, and after it"


def test_what_the_halves_log_is_their_mean():
    destroy_moe_metrics_tracker()
    tracker = get_moe_metrics_tracker()
    tracker.record("z_loss", torch.tensor(1.0), layer_number=1, num_layers=2)  # an earlier micro-batch's
    with _tracked_as_mean():
        for half in (2.0, 4.0):
            tracker.record("z_loss", torch.tensor(half), layer_number=1, num_layers=2)
            tracker.record("seq_load_balancing_loss", torch.tensor(half), layer_number=2, num_layers=2)
    values = {name: entry.values.tolist() for name, entry in tracker.metrics.items()}
    destroy_moe_metrics_tracker()
    assert values == {"z_loss": [4.0, 0.0], "seq_load_balancing_loss": [0.0, 3.0]}, values


def test_the_second_half_of_a_sequence_attends_to_the_first_halfs_keys_under_a_shifted_mask():
    """In the first half a core attention keeps its keys and values; in the second it attends to them
    (leaves) and its own, under the causal mask shifted by the first half's length, its softmax told to
    apply that mask (megatron-core's fused causal kernel would build its own square one), and restored."""
    halves = SequenceHalves()
    softmax = SimpleNamespace(attn_mask_type=AttnMaskType.causal)
    module, seen = SimpleNamespace(scale_mask_softmax=softmax), []

    def forward(query, key, value, mask, *args, **kwargs):
        seen.append((key.shape[0], mask, softmax.attn_mask_type))
        return query

    q, k = torch.zeros(2, 1, 1, 1), torch.ones(2, 1, 1, 1, requires_grad=True)
    for half in (0, 1):
        with halves.half(half):
            halves._attend(module, forward, q, k, k, None)
    (first_keys, first_mask, first_type), (keys, mask, kind) = seen
    assert (first_keys, first_mask, first_type) == (2, None, AttnMaskType.causal), seen[0]
    assert keys == 4 and kind == AttnMaskType.padding and softmax.attn_mask_type == AttnMaskType.causal, seen[1]
    assert mask[0, 0].tolist() == [[False, False, False, True], [False, False, False, False]], mask
    (tensor, leaf), _ = halves.take_prefixes()
    assert tensor is k and leaf.requires_grad and leaf.grad_fn is None, "the second half reads a leaf of the keys"


def test_yarns_cached_cos_and_sin_start_after_the_first_half(monkeypatch):
    """Multi-latent attention with rope fusion reads YaRN's cached cos and sin: in the second half they are
    those of the positions after the first half, a cache miss's forward not shifting them twice."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # cpu_compat's stand-in
    model = torch.nn.Sequential(YarnRotaryEmbedding(8, use_cpu_initialization=True))
    yarn, halves = model[0], SequenceHalves.install(model)
    with halves.half(0):
        yarn.get_cached_cos_sin(4)
    with halves.half(1):
        cos, sin = yarn.get_cached_cos_sin(4)
    whole_cos, whole_sin = yarn.get_cached_cos_sin(8)
    assert torch.equal(cos, whole_cos[4:]) and torch.equal(sin, whole_sin[4:]), "the second half's positions 4-7"
