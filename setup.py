"""Chimera for Megatron: bidirectional pipeline schedules for megatron-core GPT pretraining.

``megatron`` is a namespace package shared with megatron-core's wheel: this project's
``megatron/`` has no ``__init__.py``, or it would hide ``megatron.core``.
"""
from setuptools import find_namespace_packages, find_packages, setup

setup(
    name="chimera-megatron",
    version="0.1.0",
    description="Chimera bidirectional pipeline parallelism for Megatron GPT pretraining",
    python_requires=">=3.12",
    packages=find_packages(include=["chimera_schedules", "chimera_schedules.*"])
    + find_namespace_packages(include=["megatron.*"], exclude=["megatron.core*"]),
    install_requires=[
        # scripts/setup_env.sh pins torch==2.13.0, the release this is tested with; on a GPU cluster,
        # install beside your own CUDA torch.
        "torch",
        "megatron-core>=0.19.2,<0.20",
        "psutil",  # megatron-core's checkpoint writer
        "sentencepiece",
        "matplotlib",  # PNG timelines and benchmark plots
        "ortools",  # CP-SAT behind --order best
        "tensorboard",  # --tensorboard-dir
    ],
    extras_require={
        # GPT2BPETokenizer and HuggingFaceTokenizer, as in Megatron-LM; the tests cover both
        "hf": ["transformers"],
        "test": ["pytest", "transformers"],
        "gpu": ["transformer-engine", "apex"],
    },
)
