"""Pipeline schedules as data: Chimera (Li & Hoefler, SC'21) and its baselines, with a validator,
a time-weighted simulator and renderers. See ``python -m chimera_schedules --help``."""
from .build import build, build_spec, check
from .errors import InvalidSchedule, ScheduleConfigError
from .ir import Action, Op, Schedule, with_grad_sync
from .simulator import CostModel, SimResult, simulate
from .spec import SCHEDULES, VARIANTS, ScheduleSpec, variant
from .validator import validate

__all__ = ["SCHEDULES", "VARIANTS", "ScheduleSpec", "variant", "build", "build_spec", "check", "InvalidSchedule",
           "ScheduleConfigError", "Action", "Op", "Schedule", "with_grad_sync", "CostModel", "SimResult", "simulate",
           "validate"]
