"""Detection of the GPU software (model/kernels.py) imports the real modules and kernels: a package merely named
``apex`` (PyPI's is an unrelated project) is refused as apex, with its fusions kept off and its norm not
picked, and a ``transformer_engine`` without its PyTorch part is not used. Fake packages in a folder on
sys.path play the installs."""
import importlib
import sys

import pytest
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
from megatron.core.models import backends

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.model import chunk, kernels

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "128", "--transformer-impl", "local"]
APEX_FUSIONS = {"gradient_accumulation_fusion", "masked_softmax_fusion", "persist_layer_norm"}


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Installs fake modules: ``site({"apex/__init__.py": ""})``, forgetting what was found importable before.
    The fakes leave sys.modules after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels.importable.cache_clear()

    def install(files: dict[str, str]) -> None:
        for path, text in files.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(text)
        importlib.invalidate_caches()
        kernels.importable.cache_clear()

    yield install
    fakes = {path.name.removesuffix(".py") for path in tmp_path.iterdir()}
    for name in [name for name in sys.modules if name.partition(".")[0] in fakes]:
        del sys.modules[name]
    kernels.importable.cache_clear()


NVIDIA_APEX = {"apex/__init__.py": "", "apex/normalization/__init__.py": "",
               "apex/normalization/fused_layer_norm.py": "class FusedLayerNorm: pass\n",
               **{f"{kernel}.py": "" for kernel in kernels.APEX_KERNELS}}


def test_a_package_merely_named_apex_is_refused_with_its_fusions(site):
    assert kernels.apex_missing() == "apex is not installed"
    site({"apex/__init__.py": "VERSION = 'PyPI'\n"})
    assert kernels.importable("apex"), "the fake apex does not import"
    assert kernels.apex_missing() == "apex is not NVIDIA's apex (no apex.normalization)"
    spec = ModelSpec.from_args(parse_args(MODEL, world_size=1))
    assert set(chunk.fusions_off(spec, "cuda")) >= APEX_FUSIONS, chunk.fusions_off(spec, "cuda")
    assert chunk._torch_norm(FusedLayerNorm), "megatron-core's FusedLayerNorm kept without NVIDIA's apex"


def test_nvidias_apex_needs_its_kernels_built(site):
    """Each kernel megatron-core imports must import; one that fails its own way (a missing CUDA library) is
    a quiet no."""
    files = dict(NVIDIA_APEX)
    files[f"{kernels.WEIGHT_GRADIENT_KERNEL}.py"] = "raise OSError('libcudart.so: cannot open shared object')\n"
    site(files)
    assert kernels.apex_missing() == "apex's fused_weight_gradient_mlp_cuda kernel is not built"
    spec = ModelSpec.from_args(parse_args(MODEL, world_size=1))
    assert chunk.fusions_off(spec, "cuda")["gradient_accumulation_fusion"] == \
        "megatron-core's linears need apex's fused_weight_gradient_mlp_cuda"


def test_nvidias_apex_with_its_kernels_runs_its_fusions_and_norm(site, monkeypatch):
    site(NVIDIA_APEX)
    assert kernels.apex_missing() is None, kernels.apex_missing()
    spec = ModelSpec.from_args(parse_args(MODEL, world_size=1))
    off = chunk.fusions_off(spec, "cuda")
    assert set(off) & APEX_FUSIONS == {"persist_layer_norm"}, off  # apex's fast_layer_norm is not in the fake
    assert off["persist_layer_norm"] == "apex's persistent layer norm (its fast_layer_norm extension) is not built"
    # megatron-core picks FusedLayerNorm when apex imports; the chunk keeps it only with NVIDIA's apex
    monkeypatch.setattr(backends, "LNImpl", FusedLayerNorm)
    monkeypatch.setattr(chunk, "LNImpl", FusedLayerNorm)
    config = chunk.transformer_config(spec, 2, 0, "cpu")
    block = chunk._layer_spec(config)
    assert (block.layer_norm, block.layer_specs[0].submodules.input_layernorm) == (FusedLayerNorm, FusedLayerNorm)
    monkeypatch.delitem(sys.modules, kernels.LAYER_NORM_KERNEL)
    site({f"{kernels.LAYER_NORM_KERNEL}.py": "raise ImportError('not built')\n"})
    block = chunk._layer_spec(config)
    assert (block.layer_norm, block.layer_specs[0].submodules.input_layernorm) == (chunk.LocalNorm, chunk.LocalNorm)


def test_transformer_engine_without_its_pytorch_part_is_not_used(site):
    site({"transformer_engine/__init__.py": ""})
    assert kernels.importable("transformer_engine")
    assert not kernels.transformer_engine_usable()
    assert not chunk.uses_transformer_engine("transformer_engine", "cuda")
    site({"transformer_engine/pytorch/__init__.py": ""})
    assert kernels.transformer_engine_usable()
    assert chunk.uses_transformer_engine("transformer_engine", "cuda")
    assert not chunk.uses_transformer_engine("transformer_engine", "cpu")
    assert not chunk.uses_transformer_engine("local", "cuda")
