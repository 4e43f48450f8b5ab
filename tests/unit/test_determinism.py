"""--deterministic-mode where it changes something a test can see: Megatron-LM's validate_args (inside
parse_args) sets the environment of its deterministic functional tests and torch's deterministic algorithms,
under which torch fills uninitialised memory with NaN; every chunk's config carries megatron-core's
``deterministic_mode`` (its embedding then gathers rows). Without the flag none of it happens."""
import os

import pytest
import torch

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.model import chunk
from megatron.chimera.testing.equivalence import MODEL
from megatron.chimera.testing.plans import plan_of

ENVIRONMENT = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
FLAGS = MODEL + ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]


@pytest.fixture
def mode_restored(monkeypatch):
    """The environment and torch's switch as they were, whatever the test set."""
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("on", [False, True])
def test_deterministic_mode_sets_what_megatron_lm_sets(mode_restored, on):
    args = parse_args(FLAGS + (["--deterministic-mode"] if on else []), world_size=2)
    assert {n: os.environ.get(n) for n in ENVIRONMENT} == (ENVIRONMENT if on else dict.fromkeys(ENVIRONMENT)), \
        f"deterministic mode {on}: environment {[os.environ.get(n) for n in ENVIRONMENT]}"
    assert torch.are_deterministic_algorithms_enabled() is on, f"torch's deterministic algorithms not {on}"
    assert bool(torch.empty(64).isnan().all()) is on, f"uninitialised memory NaN-filled is not {on}"
    spec, plan = ModelSpec.from_args(args), plan_of(args)
    configs = [chunk.transformer_config(spec, held.layers, plan.layout.first_layer(stage), "cpu", False)
               for stage, held in enumerate(plan.layout.stages)]
    modes = {config.deterministic_mode for config in configs}
    assert modes == {on}, f"chunks' deterministic_mode {modes}, the flag {on}"


def test_a_nondeterministic_nccl_algorithm_is_refused_in_one_line(mode_restored, monkeypatch, capsys):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(SystemExit) as refused:
        parse_args(FLAGS + ["--deterministic-mode"], world_size=2)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "NCCL_ALGO='Tree'" in err, err
