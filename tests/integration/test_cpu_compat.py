"""The CPU compatibility layer: megatron-core's GPT runs forward and backward on the CPU once it is
applied, and the RNG tracker it installs behaves like megatron-core's (fork restores the caller's state)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.chimera.model import cpu_compat
from megatron.chimera.testing.launch import launch


def test_rng_tracker_forks_and_restores_cpu_state(one_process_group):
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, cpu_compat.CpuRNGStatesTracker)
    tracker.reset()
    tracker.add("model-parallel-rng", 99)
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    with tracker.fork():
        second = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(first, second)  # the tracked stream advances


@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
def test_gpt_forward_and_backward_on_cpu(one_process_group, positions):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.1, attention_dropout=0.1, gradient_accumulation_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                     position_embedding_type=positions)
    tokens = torch.randint(0, 64, (2, 16))
    losses = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)  # no mask: default causal
    losses.mean().backward()
    assert losses.shape == (2, 16) and torch.isfinite(losses).all()
    bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert bad == [], f"parameters without a finite gradient: {bad}"


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="with a driver the real CUDA calls work; the shims are for CPU hosts")
def test_every_redirection_is_still_needed_by_megatron_core():
    """Each shim undone in turn breaks the megatron-core code it exists for
    (megatron/chimera/testing/cpu_shim_probe.py): when a megatron-core release stops needing one, this names it,
    and it should go."""
    proc = subprocess.run([sys.executable, "-m", "megatron.chimera.testing.cpu_shim_probe"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(error is None for error in found["control"].values()), found["control"]
    report = found["without"]
    assert set(report) == {"current_device", "synchronize", "rng_tracker", "cuda_rng_state",
                           "schedules_token_counter", "default_causal_mask", "dispatcher_stream",
                           "dispatcher_split_sizes", "schedule_plan_streams", "record_stream", "rope_cp_chunks"}
    assert all(error is not None for error in report.values()), report


def test_parts_of_different_sizes_are_gathered_and_reduce_scattered_on_gloo():
    """megatron-core's alltoall dispatcher with expert and expert-tensor parallelism gathers each expert-TP
    rank's tokens, whose counts differ (and reduce-scatters their gradients back); gloo takes equal parts
    only, cpu_compat pads them (Megatron-LM's Mixtral and MoE configs at EP > 1 with ETP > 1)."""
    proc = launch(2, "-m", "megatron.chimera.testing.uneven_collectives_probe")
    said = [json.loads(found) for found in re.findall(r'\{"rank".*?\}', proc.stdout)]
    assert len(said) == 2 and all(r["gathered"] and r["reduce_scattered"] for r in said), proc.stdout + proc.stderr
