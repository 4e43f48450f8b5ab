"""The two ways a schedule request fails, each with a one-line message a user can act on."""
from __future__ import annotations


class ScheduleConfigError(ValueError):
    """An impossible request (odd depth for Chimera, N not a multiple of what the schedule needs, ...).

    ``option`` is the command-line flag that carries the offending value, so the CLI and the training
    program can both name it."""

    def __init__(self, option: str, value, rule: str):
        self.option, self.value, self.rule = option, value, rule
        super().__init__(f"{option}={value}: {rule}")


class InvalidSchedule(ValueError):
    """A schedule the validator rejects; names the first offending action and its worker."""

    def __init__(self, reason: str, worker: int | None = None, action=None):
        self.reason, self.worker, self.action = reason, worker, action
        where = ""
        if worker is not None:
            where = f"worker {worker}" + (f", action {action}" if action is not None else "") + ": "
        super().__init__(where + reason)


def require(condition: bool, option: str, value, rule: str) -> None:
    if not condition:
        raise ScheduleConfigError(option, value, rule)
