"""--optimizer muon's split and step in one process (no process group: no tensor parallelism): megatron-core's
Muon for the hidden matrices, AdamW for the rest, one state map, and a checkpoint's tensors restored."""
import types

import torch

from megatron.chimera.optim.muon import MOMENTUM, build_muon, loaded_state, mark_parameters, steps_with_muon

SPEC = types.SimpleNamespace(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                             muon={"muon_momentum": 0.9, "muon_fp32_matmul_prec": "high"})
CONFIG = types.SimpleNamespace(num_attention_heads=2, num_query_groups=2, kv_channels=4)


def _chunk() -> torch.nn.Module:
    """A layer's worth of parameters named as megatron-core names them, the embedding marked as its LanguageModule
    marks it."""
    torch.manual_seed(0)
    chunk = torch.nn.Module()
    chunk.config = CONFIG
    chunk.register_parameter("word_embeddings", torch.nn.Parameter(torch.randn(16, 8)))
    chunk.word_embeddings.is_embedding_or_output_parameter = True
    chunk.register_parameter("projection", torch.nn.Parameter(torch.randn(24, 8)))
    chunk.register_parameter("norm", torch.nn.Parameter(torch.ones(8)))
    for p in chunk.parameters():
        p.grad = torch.randn_like(p)
    return chunk


def test_matrices_step_with_muon_and_the_rest_with_adamw_in_one_state_map():
    chunk = _chunk()
    params = list(chunk.parameters())
    optimizer = build_muon([{"params": params, "wd_mult": 1.0}], SPEC, torch.device("cpu"), [chunk])
    assert [steps_with_muon(p) for p in params] == [False, True, False], "megatron-core's split changed"
    assert len(optimizer.optimizers) == 2 and len(optimizer.param_groups) == 2, optimizer.param_groups
    assert set(optimizer.state[params[1]]) == {MOMENTUM}, "Muon's momentum is not allocated before the first step"
    before = [p.detach().clone() for p in params]
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params)), "a parameter did not step"
    assert set(optimizer.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}, "the embedding is not AdamW's"
    assert set(optimizer.state[params[2]]) == {"step", "exp_avg", "exp_avg_sq"}, "the norm is not AdamW's"
    assert optimizer.optimizers[1].state is optimizer.state, "AdamW keeps a state map of its own"


def test_a_checkpoints_tensors_restore_each_optimizers_state():
    param = torch.nn.Parameter(torch.zeros(3, 3))
    optimizer = types.SimpleNamespace(defaults={})
    momentum = torch.ones(3, 3)
    assert loaded_state(optimizer, param, 5, {MOMENTUM: momentum}) == {MOMENTUM: momentum}
    adam = loaded_state(optimizer, param, 5, {"exp_avg": momentum, "exp_avg_sq": momentum})
    assert float(adam["step"]) == 5 and adam["exp_avg"] is momentum, adam


def test_the_fused_qkv_weight_is_marked_for_megatron_cores_split():
    chunk = torch.nn.Module()
    chunk.config = CONFIG
    attention = torch.nn.Module()
    attention.register_parameter("weight", torch.nn.Parameter(torch.zeros(24, 8)))  # 2 query groups x (4 + 4 + 4)
    chunk.add_module("linear_qkv", attention)
    mark_parameters([chunk])
    assert attention.weight.is_qkv and attention.weight.qkv_split_shapes == [4, 4, 4], vars(attention.weight)
