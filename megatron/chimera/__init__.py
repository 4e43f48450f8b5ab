"""Our training program, beside megatron-core in the ``megatron`` namespace package."""
import logging
import warnings

# megatron-core warns at import, once per module, that Transformer Engine and apex are missing; on a
# CPU (where they never are) that was most of a run's output. The README says which parts are local.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed. Falling back to Torch Norm")
# megatron.training's import reaches the Transformer Engine spec provider, which warns about MoE without TE
warnings.filterwarnings("ignore", message="Only transformer-engine>=1.7.0 supports MoE experts")
# megatron-core's timers gather with a collective torch 2.13 deprecates; one FutureWarning per rank
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor. is deprecated")
# megatron-core 0.19 asks for the rank before torch.distributed exists (argument checks run first) and
# warns that it defaults to 0; our checks print on rank 0 only, on purpose.
warnings.filterwarnings("ignore", message="Could not determine rank from torch.distributed")
# torch's CUDA build on a machine without a driver logs this once per process at import, on every rank
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
from .arguments import parse_args  # noqa: E402
from .config.job import JobConfig, job_config  # noqa: E402
from .config.run_plan import RunPlan, make_run_plan  # noqa: E402
from .loop import Trainer, pretrain  # noqa: E402
from .observability.hooks import Hooks  # noqa: E402

__all__ = ["parse_args", "job_config", "JobConfig", "make_run_plan", "RunPlan", "Trainer", "pretrain", "Hooks"]
