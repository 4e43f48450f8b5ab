"""What GPU software is really installed: Transformer Engine with its PyTorch part, and NVIDIA's apex with the
compiled kernels megatron-core imports.

A package's name on the path says too little. PyPI's ``apex`` is an unrelated project, and
``transformer-engine`` without its ``[pytorch]`` extra has no torch module: a check by name
(``importlib.util.find_spec``) would pick Transformer Engine's layers or turn a fusion on, and the build or the
first step would then fail. So each answer here imports what megatron-core itself imports for the feature,
once per process (``importable`` is cached; tests clear it with ``importable.cache_clear()``), and a failed
import is an answer, never an error or a warning.
"""
from __future__ import annotations

import functools
import importlib
import warnings

# apex's compiled extensions, as megatron-core imports them: the weight-gradient GEMM of its linears
# (tensor_parallel/layers.py, for gradient_accumulation_fusion), the causal and the masked softmax
# (fusions/fused_softmax.py, for masked_softmax_fusion), and the layer norm behind its FusedLayerNorm
# (apex.normalization.fused_layer_norm loads it when the norm is built)
WEIGHT_GRADIENT_KERNEL = "fused_weight_gradient_mlp_cuda"
SOFTMAX_KERNELS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")
LAYER_NORM_KERNEL = "fused_layer_norm_cuda"
APEX_KERNELS = (LAYER_NORM_KERNEL, WEIGHT_GRADIENT_KERNEL, *SOFTMAX_KERNELS)
# megatron-core's FusedLayerNorm with persist_layer_norm: apex's contrib FastLayerNormFN (apex built with
# its fast_layer_norm extension); without it megatron-core falls back to the non-persistent kernel
PERSISTENT_LAYER_NORM = "apex.contrib.layer_norm.layer_norm"


@functools.cache
def importable(module: str) -> bool:
    """Whether ``import module`` works here, its warnings silenced."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except Exception:  # a broken build fails its own way: ImportError, OSError for a missing CUDA library, ...
        return False
    return True


def transformer_engine_usable() -> bool:
    """Transformer Engine with its PyTorch part, which megatron-core's Transformer Engine layers are built on."""
    return importable("transformer_engine.pytorch")


def apex_missing() -> str | None:
    """None where NVIDIA's apex is installed with the kernels megatron-core imports (``APEX_KERNELS``), else
    why not, in one line."""
    if not importable("apex"):
        return "apex is not installed"
    if not importable("apex.normalization.fused_layer_norm"):
        return "apex is not NVIDIA's apex (no apex.normalization)"
    for kernel in APEX_KERNELS:
        if not importable(kernel):
            return f"apex's {kernel} kernel is not built"
    return None
