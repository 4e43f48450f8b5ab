"""Our training program, beside megatron-core in the ``megatron`` namespace package."""
import warnings

# megatron-core warns at import, once per module, that Transformer Engine and apex are missing; on a
# CPU (where they never are) that was most of a run's output. The README says which parts are local.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed. Falling back to Torch Norm")
# megatron-core's timers gather with a collective torch 2.13 deprecates; one FutureWarning per rank
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor. is deprecated")
from .arguments import parse_args  # noqa: E402
from .training import Trainer, pretrain  # noqa: E402

__all__ = ["parse_args", "Trainer", "pretrain"]
