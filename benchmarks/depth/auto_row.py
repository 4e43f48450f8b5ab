"""The ``auto`` row: the plan ``--pipeline-schedule auto`` picks for this run, run beside the others.

The pick comes from the planning layer the trainer calls (``chimera_schedules.tools.auto``), asked what a
run of this model at depth D, one data-parallel replica and N micro-batches of one sample allows, and
priced at the costs the emulated stages wait (``Setup.costs``): the stage costs a run measures on its own
devices. Like the layouts (layouts.py) it chooses by time alone (the emulated device holds no model; the
row keeps the planner's memory of its largest worker). Its name is ``auto: <variant>``, its layout the
pick's (the even split, or the balancer's).
"""
from __future__ import annotations

import math

from chimera_schedules.ir import layout
from chimera_schedules.tools import auto
from chimera_schedules.tools.planner import even_layout

from . import runtimes
from .layouts import Chosen

AUTO = "auto"
PREFIX = AUTO + ": "


def pick(setup, n: int) -> auto.Candidate:
    """The planning layer's fastest plan for N = ``n`` at this run's stage costs."""
    request = auto.Request(setup.shape, setup.profile, setup.depth, 1, n, (1,), math.inf,
                           overlap=bool(setup.a2a_fraction), priced=lambda v, held, b: setup.costs(v, held))
    return auto.ranked(request)[0]


def entry(setup, n: int) -> tuple:
    """The auto case as ``__main__.plan`` lists cases: (runtime, name, N, contention, order, layout)."""
    c = pick(setup, n)
    order = runtimes.ours_schedule(setup, c.schedule, n)
    balanced = isinstance(c, auto.Balanced)
    held = layout.parse(c.layout) if balanced else even_layout(setup.shape, setup.depth * order.virtual_stages)
    chosen = Chosen("balanced" if balanced else "even", held, memory=c.memory, fits=c.memory <= setup.profile.memory)
    return "ours", PREFIX + c.schedule, n, 0.0, order, chosen
