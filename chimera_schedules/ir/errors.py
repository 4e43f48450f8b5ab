"""The two ways a request fails, each with a one-line message a user can act on: a flag's value that
breaks a rule (``ConfigError``), and a schedule the validator rejects (``InvalidSchedule``)."""
from __future__ import annotations

from collections.abc import Mapping
from string import Template

from .spec import flags


class ConfigError(ValueError):
    """An impossible request (odd depth for Chimera, N not a multiple of what the schedule needs, a
    checkpoint that does not fit the model, ...).

    ``option`` names what carries the offending value: a ScheduleSpec field (``"concat"``) when the
    schedule library raises it, whose ``rule`` may name other fields as ``$depth``; else a front end's
    own flag (``"--out"``). Each front end prints ``message`` with its flags, so the user reads the flag
    they typed; ``str()`` speaks the CLI's."""

    def __init__(self, option: str, value, rule: str):
        self.option, self.value, self.rule = option, value, rule
        super().__init__(self.message(flags("cli")))

    def message(self, names: Mapping[str, str]) -> str:
        """One line, with every field spelled as ``names`` maps it (field -> flag)."""
        rule = Template(self.rule).safe_substitute(names)
        return f"{names.get(self.option, self.option)}={self.value}: {rule}"


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
        raise ConfigError(option, value, rule)
