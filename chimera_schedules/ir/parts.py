"""The parts of a stage's forward and backward when its layers are mixture-of-experts layers, and how an
overlapped F&B action interleaves two micro-batches' parts on two streams.

A MoE layer's forward runs in four parts, megatron-core 0.19's fine-grained callables
(``build_transformer_layer_callables``): attention (with the router and the dispatch preprocessing:
compute), dispatch (the all-to-all that sends each token to its experts: communication), experts
(compute), combine (the all-to-all back, and the residual: communication). Its backward runs them in the
reverse order: combine, experts, dispatch, attention. A dense layer has the same four parts, its two
all-to-alls taking no time.

An overlapped action runs the forward of one micro-batch and the backward (or I) of another layer by
layer, in megatron-core's combined-1F1B order (``TransformerLayerSchedulePlan.run``): forward layer i
beside backward layer L-1-i as

    comm:     combine_b | dispatch_f  dispatch_b | combine_f
    compute:  attention_f | experts_b  experts_f | attention_b

so each all-to-all of one micro-batch runs while the other computes. Parts of one micro-batch run one
after another (each needs the one before: megatron-core's one event per model chunk); each stream runs
its parts in the order they are issued. ``timeline`` is that rule, and with it the simulator prices an
overlapped action, the emulated device of the depth benchmark runs one, and the docs draw one.

A halved action (``Halved``) runs one pass as two halves of its micro-batch, ``halves`` issuing them
layer by layer in the same two-stream way, one half a part ahead of the other:

    comm:       dispatch_a | dispatch_b  combine_a | combine_b
    compute:  attention_a | attention_b  experts_a | experts_b  attention_a (next layer) ...

A half moves half the tokens (half the all-to-all) and computes half as much, divided by an efficiency
factor (smaller kernels on a GPU run below their full rate; 1.0 on the emulated device).

Contention: on a GPU an all-to-all takes streaming multiprocessors (DeepEP uses about 20 of an H100's
132), so compute beside it runs slower. ``timeline(order, contention)`` stretches each compute part by
``contention`` times how long an all-to-all was in flight during it: compute progresses at 1 / (1 +
contention) of its rate while one is. The stretch moves what follows, which moves the all-to-alls;
``timeline`` settles it by replaying a few times (``_CONTENTION_ROUNDS``), each with the stretches of
the previous replay.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

COMPUTE, COMM = "compute", "comm"
_CONTENTION_ROUNDS = 4
FORWARD_ORDER = ("attention", "dispatch", "experts", "combine")
_STREAM = {"attention": COMPUTE, "dispatch": COMM, "experts": COMPUTE, "combine": COMM}


@dataclass(frozen=True)
class Part:
    """One part of one micro-batch's pass through one layer: ``role`` "F" for the forward, "B" for the
    backward (a B or an I), ``layer`` its index within the stage, ``half`` which half of a halved
    action's micro-batch (0 or 1; -1 for a whole one). A part follows the previous part of its chain:
    its role and half."""

    role: str
    layer: int
    name: str
    time: float
    half: int = -1

    @property
    def stream(self) -> str:
        return _STREAM[self.name]

    @property
    def chain(self) -> tuple[str, int]:
        return self.role, self.half

    def __str__(self) -> str:
        return f"{self.name}_{self.role.lower()}{self.layer}" + ("ab"[self.half] if self.half >= 0 else "")


def forward_parts(compute: float, a2a: float, layers: int, attention_share: float) -> list[Part]:
    """A forward through ``layers`` equal layers that together compute for ``compute`` and spend ``a2a``
    in all-to-alls (half dispatch, half combine); ``attention_share`` of each layer's compute is its
    attention part, the rest its experts."""
    return [part for layer in range(layers) for part in _layer("F", layer, compute / layers, a2a / layers,
                                                               attention_share)]


def backward_parts(compute: float, a2a: float, layers: int, attention_share: float) -> list[Part]:
    """A backward (or an I) through the same layers, last layer first, each layer's parts reversed."""
    return [part for layer in reversed(range(layers))
            for part in reversed(_layer("B", layer, compute / layers, a2a / layers, attention_share))]


def _layer(role: str, layer: int, compute: float, a2a: float, share: float) -> list[Part]:
    times = {"attention": compute * share, "dispatch": a2a / 2, "experts": compute * (1 - share), "combine": a2a / 2}
    return [Part(role, layer, name, times[name]) for name in FORWARD_ORDER]


def by_layer(parts: list[Part]) -> list[list[Part]]:
    """The parts grouped by layer, in the order the pass runs its layers."""
    groups: list[list[Part]] = []
    for part in parts:
        if not groups or groups[-1][0].layer != part.layer:
            groups.append([])
        groups[-1].append(part)
    return groups


def interleave(forward: list[Part], backward: list[Part]) -> list[Part]:
    """megatron-core's combined-1F1B issue order of one forward and one backward: layer pairs as the
    module says, then the backward's remaining layers, then the forward's."""
    f_layers, b_layers = by_layer(forward), by_layer(backward)
    order = []
    pairs = min(len(f_layers), len(b_layers))
    for f, b in zip(f_layers[:pairs], b_layers[:pairs]):
        fp, bp = {p.name: p for p in f}, {p.name: p for p in b}
        order += [bp["combine"], fp["attention"], bp["experts"], fp["dispatch"], bp["dispatch"], fp["experts"],
                  fp["combine"], bp["attention"]]
    for rest in b_layers[pairs:] + f_layers[pairs:]:
        order += rest
    return order


def halves(whole: list[Part], efficiency: float = 1.0) -> list[Part]:
    """The issue order of a pass (``whole``: one micro-batch's parts, as ``forward_parts`` or
    ``backward_parts`` make them) run as two halves of its micro-batch: per layer, half a's compute
    and all-to-all parts each followed by half b's (the module's drawing). A half's all-to-all is half
    the whole's, its compute half the whole's divided by ``efficiency``."""
    def half(part: Part, k: int) -> Part:
        scale = 0.5 if part.stream == COMM else 0.5 / efficiency
        return replace(part, time=part.time * scale, half=k)

    order = []
    for layer in by_layer(whole):
        for first, second in zip(layer[::2], layer[1::2]):  # (compute, all-to-all) in the pass's order
            order += [half(first, 0), half(second, 0), half(first, 1), half(second, 1)]
    return order


def timeline(order: list[Part], contention: float = 0.0, ready: dict[str, float] | None = None,
             host: float = 0.0) -> list[tuple[Part, float, float]]:
    """(part, start, end) of each part issued in ``order``: a part starts when its stream is free and the
    previous part of its chain has ended (the first of a role's chain when its input is there:
    ``ready[role]``, default 0); under ``contention`` a compute part also takes that much longer per
    unit of time an all-to-all runs beside it (the module's docstring); each part that takes time takes
    ``host`` longer (what issuing it costs: ``CostModel.host``)."""
    stretch, ready = [0.0] * len(order), ready or {}
    events = _issue(order, stretch, ready, host)
    for _ in range(_CONTENTION_ROUNDS if contention > 0 else 0):
        comm = [(start, end) for part, start, end in events if part.stream == COMM and end > start]
        # work w done over d with an all-to-all in flight for t of it: w = d - t + t / (1 + c)
        stretch = [contention / (1 + contention) * _beside(start, end, comm) if part.stream == COMPUTE else 0.0
                   for part, start, end in events]
        events = _issue(order, stretch, ready, host)
    return events


def _issue(order: list[Part], stretch: list[float], ready: dict[str, float],
           host: float) -> list[tuple[Part, float, float]]:
    stream_free = {COMPUTE: 0.0, COMM: 0.0}
    chain_end: dict[tuple[str, int], float] = {}
    out = []
    for part, extra in zip(order, stretch):
        start = max(stream_free[part.stream], chain_end.get(part.chain, ready.get(part.role, 0.0)))
        end = start + part.time + extra + (host if part.time > 0 else 0.0)
        stream_free[part.stream] = chain_end[part.chain] = end
        out.append((part, start, end))
    return out


def _beside(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    """How long the intervals ``busy`` (one stream's, so disjoint) overlap [start, end]."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)


def span(order: list[Part], contention: float = 0.0, host: float = 0.0) -> float:
    """How long the parts issued in ``order`` take, from the first start to the last end."""
    return max((end for _, _, end in timeline(order, contention, host=host)), default=0.0)


def ascii_timeline(order: list[Part], width: int = 72) -> str:
    """The two streams of ``order`` as text, one row each, a part drawn as its name over its time."""
    events = timeline(order)
    total = max((end for _, _, end in events), default=0.0) or 1.0
    rows = []
    for stream in (COMM, COMPUTE):
        line = [" "] * width
        for part, start, end in events:
            if part.stream != stream or end <= start:
                continue
            a, b = round(start / total * width), max(round(start / total * width) + 1, round(end / total * width))
            label = f"|{part}"[: b - a].ljust(b - a, "-")
            line[a:b] = label
        rows.append(f"{stream:>8} {''.join(line)}")
    return "\n".join(rows)
