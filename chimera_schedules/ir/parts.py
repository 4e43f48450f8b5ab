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
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE, COMM = "compute", "comm"
FORWARD_ORDER = ("attention", "dispatch", "experts", "combine")
_STREAM = {"attention": COMPUTE, "dispatch": COMM, "experts": COMPUTE, "combine": COMM}


@dataclass(frozen=True)
class Part:
    """One part of one micro-batch's pass through one layer: ``role`` "F" for the forward, "B" for the
    backward (a B or an I), ``layer`` its index within the stage."""

    role: str
    layer: int
    name: str
    time: float

    @property
    def stream(self) -> str:
        return _STREAM[self.name]

    def __str__(self) -> str:
        return f"{self.name}_{self.role.lower()}{self.layer}"


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


def timeline(order: list[Part]) -> list[tuple[Part, float, float]]:
    """(part, start, end) of each part issued in ``order``: a part starts when its stream is free and the
    previous part of its own micro-batch has ended."""
    stream_free = {COMPUTE: 0.0, COMM: 0.0}
    chain_end = {"F": 0.0, "B": 0.0}
    out = []
    for part in order:
        start = max(stream_free[part.stream], chain_end[part.role])
        end = start + part.time
        stream_free[part.stream] = chain_end[part.role] = end
        out.append((part, start, end))
    return out


def span(order: list[Part]) -> float:
    """How long the parts issued in ``order`` take, from the first start to the last end."""
    return max((end for _, _, end in timeline(order)), default=0.0)


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
