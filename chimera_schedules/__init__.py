"""Pipeline schedules as data: Chimera (Li & Hoefler, SC'21) and its baselines, with a validator, an
NCCL checker, a time-weighted simulator, renderers and one executor. See
``python -m chimera_schedules --help``.

Layers, each importing only the ones before it (``tests/unit/test_layers.py`` walks the imports):
``ir`` -> ``analysis`` -> ``passes`` -> ``generators`` -> ``registry`` -> ``tools``; ``runtime``
imports only ``ir``.
"""
from .analysis.simulator import SimResult, simulate
from .analysis.validator import validate
from .ir.actions import Action, Op
from .ir.costs import CostModel
from .ir.errors import ConfigError, InvalidSchedule
from .ir.schedule import Schedule
from .ir.spec import ScheduleSpec
from .passes.grad_sync import with_grad_sync
from .registry import SCHEDULES, VARIANTS, build, build_spec, check, variant

__all__ = ["SCHEDULES", "VARIANTS", "ScheduleSpec", "variant", "build", "build_spec", "check", "InvalidSchedule",
           "ConfigError", "Action", "Op", "Schedule", "with_grad_sync", "CostModel", "SimResult", "simulate",
           "validate"]
