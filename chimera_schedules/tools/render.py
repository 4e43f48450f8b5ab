"""Pictures of a timeline: ASCII for the terminal, SVG/PNG like the paper's Figure 1, and a Chrome /
Perfetto trace. They draw any ``SimResult`` (simulated) or an object with the same fields (measured
timestamps), so predicted and measured runs look alike. An overlapped action fills one slot: in ASCII
one label (``F3&B1``), in pictures two half-height boxes, its forward above its backward."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from html import escape

from ..analysis.simulator import SimResult
from ..ir import parts as moe
from ..ir.actions import Op, parts
from ..ir.costs import CostModel, Event
from ..ir.errors import ConfigError

# Pipeline colours: forward saturated, backward (B or I) light, as in the paper (down blue, up
# orange-ish); a split backward's W pass in a colour of its own per pipeline.
_COLOURS = [("#2f6db5", "#a9c8ec", "#f2d16b"), ("#e07b39", "#f6c9a9", "#9ccc65"),
            ("#3a9a5b", "#b3e0c2", "#e6a0c4"), ("#8a4fb0", "#d9c2ea", "#c9c26b"),
            ("#b5473a", "#eab6ae", "#7fc4d6"), ("#3a8f9a", "#b0dde3", "#d6a77f"),
            ("#9a8a3a", "#e3dcae", "#a3a3e0"), ("#5a5a5a", "#cfcfcf", "#e0c0a3")]
_FILL = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.BACKWARD_INPUT: 1, Op.BACKWARD_WEIGHT: 2}


def direction_mark(pipelines: int, pipeline: int) -> str:
    """'v' / '^' for Chimera's down and up pipelines, the pipeline number beyond two, '' for one."""
    if pipelines == 1:
        return ""
    if pipelines == 2:
        return "v^"[pipeline]
    return f"p{pipeline}"


def label(result: SimResult, e: Event) -> str:
    """Op, micro-batch and direction (``F3v``); an overlapped action's parts joined by ``&``, a halved
    one's followed by ``/2``."""
    mark = lambda a: direction_mark(result.schedule.pipelines, a.pipeline)  # noqa: E731
    text = "&".join(f"{a.op.value}{a.mb}{mark(a)}" for a in parts(e.action))
    return text + ("/2" if e.action.op is Op.HALVED else "")


def _title(result: SimResult) -> str:
    s = result.schedule
    return (f"{s.name}: D={s.depth} N={s.microbatches} P={s.pipelines}"
            + (f" v={s.virtual_stages}" if s.virtual_stages > 1 else "")
            + f" | makespan {result.makespan:g} | bubble ratio {result.bubble_ratio:.3f}")


def ascii_timeline(result: SimResult) -> str:
    """One row per worker; each time quantum is a fixed-width cell. Forwards are drawn as their label,
    backwards (B, I) and overlapped actions (``F3&B1``) as their label followed by '=', W passes
    followed by '~', bubbles as '.'."""
    durations = [e.end - e.start for e in result.events if e.end > e.start]
    quantum = min(durations) if durations else 1.0
    for _ in range(4):  # a grid on which every start falls (transfer delays shift starts off it)
        if all(abs(e.start / quantum - round(e.start / quantum)) < 1e-6 for e in result.events):
            break
        quantum /= 2
    labels = {id(e): label(result, e) for e in result.events}
    cell = max(map(len, labels.values()), default=2) + 1
    width = int(math.ceil(result.makespan / quantum - 1e-9))
    rows = []
    for w in range(result.schedule.num_workers):
        line = ["." * cell] * width
        for e in (e for e in result.events if e.worker == w):
            first = int(round(e.start / quantum))
            span = max(1, int(round((e.end - e.start) / quantum)))
            fill = " =~"[_FILL[parts(e.action)[-1].op]]  # an overlapped action continues as its backward
            text = labels[id(e)].ljust(span * cell - 1, fill) + "|"
            for k in range(span):
                line[first + k] = text[k * cell:(k + 1) * cell]
        rows.append(f"P{w:<3}|" + "".join(line))
    ruler = "    |" + "".join(f"{k * quantum:<{cell}g}" if k % 5 == 0 else " " * cell for k in range(width))
    stats = result.stats()
    footer = (f"peak activations {stats['peak_activations']}  stage copies {stats['stage_copies']}  "
              f"(label = op, micro-batch, direction; '=' continues a backward, '~' a W; '.' is a bubble)")
    return "\n".join([_title(result), ruler, *rows, footer, *_posting_order(result)])


def _posting_order(result: SimResult) -> list[str]:
    """For a lowered schedule: what each worker posts, in order (tokens as in ir/actions.py)."""
    s = result.schedule
    if not s.lowered:
        return []
    return ["posting order (sA = send activation, rG = receive gradient, > to / < from worker, @ group, "
            "AR = all-reduce):"] + [f"P{w:<3}| {s.tokens(w)}" for w in range(s.num_workers)]


@dataclass(frozen=True)
class _Box:
    x: float
    y: float
    w: float
    h: float
    fill: str
    text: str


_TRANSFER_COLOURS = {"act": "#4a4a8a", "grad": "#8a4a4a"}


def _boxes(result: SimResult) -> tuple[list[_Box], float, float]:
    """Layout in time units (x) and rows (y): compute boxes per worker; under the row, incoming
    transfers of a lowered schedule (dark blue: activations, dark red: gradients) and reductions (grey)
    as thin bars. Returns boxes, total width, total height."""
    boxes = []
    for e in result.events:
        halves = parts(e.action) * (2 if e.action.op is Op.HALVED else 1)  # a halved action: two thin boxes
        for k, a in enumerate(halves):
            fill = _COLOURS[a.pipeline % len(_COLOURS)][_FILL[a.op]]
            h = 0.74 / len(halves)
            boxes.append(_Box(e.start, e.worker + k * h, e.end - e.start, h, fill, str(a.mb)))
    for e in result.transfers:
        if e.action.op is Op.RECV and e.end > e.start:
            boxes.append(_Box(e.start, e.worker + 0.76, e.end - e.start, 0.09, _TRANSFER_COLOURS[e.action.kind], ""))
    for e in result.reductions:
        if e.end > e.start:
            boxes.append(_Box(e.start, e.worker + 0.86, e.end - e.start, 0.09, "#888888", ""))
    return boxes, max(result.makespan, 1e-9), result.schedule.num_workers


def svg_timeline(result: SimResult, px_per_unit: float | None = None) -> str:
    boxes, width, rows = _boxes(result)
    px = px_per_unit or max(8.0, min(40.0, 1200.0 / width))
    left, top, row_h = 48, 40, 28
    legend_y = top + rows * row_h + 12
    W, H = left + width * px + 20, legend_y + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W:.0f}" height="{H:.0f}" '
           f'font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="20" font-size="13">{escape(_title(result))}</text>']
    for w in range(rows):
        y = top + w * row_h
        out.append(f'<text x="6" y="{y + row_h * 0.55:.1f}">P{w}</text>')
        out.append(f'<rect x="{left}" y="{y:.1f}" width="{width * px:.1f}" height="{row_h * 0.8:.1f}" '
                   f'fill="none" stroke="#dddddd" stroke-dasharray="3,3"/>')
    for b in boxes:
        x, y = left + b.x * px, top + b.y * row_h
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{b.w * px:.1f}" height="{b.h * row_h:.1f}" '
                   f'fill="{b.fill}" stroke="#333333" stroke-width="0.6"/>')
        if b.text:
            out.append(f'<text x="{x + b.w * px / 2:.1f}" y="{y + b.h * row_h * 0.65:.1f}" '
                       f'text-anchor="middle">{escape(b.text)}</text>')
    split = _has_weight_passes(result)
    for i, (name, colours) in enumerate(_legend(result)):
        x = left + i * (250 if split else 190)
        for k, colour in enumerate(colours[:3 if split else 2]):
            out.append(f'<rect x="{x + 16 * k}" y="{legend_y}" width="14" height="12" fill="{colour}" stroke="#333"/>')
        kinds = "forward / I / W" if split else "forward / backward"
        out.append(f'<text x="{x + (52 if split else 36)}" y="{legend_y + 10}">{escape(name)} {kinds}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _has_weight_passes(result: SimResult) -> bool:
    return any(e.action.op is Op.BACKWARD_WEIGHT for e in result.events)


def _legend(result: SimResult) -> list[tuple[str, tuple[str, str, str]]]:
    p = result.schedule.pipelines
    names = ["down", "up"] if p == 2 else [f"pipeline {i}" for i in range(p)]
    return [(names[i], _COLOURS[i % len(_COLOURS)]) for i in range(p)]


def png_timeline(result: SimResult, path: str) -> None:
    import matplotlib  # here, not at the top: 2 s to import with pyplot, and only a PNG selects Agg

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    boxes, width, rows = _boxes(result)
    fig, ax = plt.subplots(figsize=(min(24, 3 + width * 0.35), 1.2 + rows * 0.45))
    for b in boxes:
        ax.add_patch(Rectangle((b.x, b.y), b.w, b.h, facecolor=b.fill, edgecolor="#333333", linewidth=0.6))
        if b.text:
            ax.text(b.x + b.w / 2, b.y + b.h / 2, b.text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, width)
    ax.set_ylim(rows, 0)
    ax.set_yticks([w + 0.4 for w in range(rows)], [f"P{w}" for w in range(rows)])
    ax.set_xlabel("time")
    ax.set_title(_title(result), fontsize=10)
    kinds = ("forward", "I", "W") if _has_weight_passes(result) else ("forward", "backward")
    handles = [Patch(facecolor=c, edgecolor="#333333", label=f"{name} {kind}")
               for name, colours in _legend(result) for kind, c in zip(kinds, colours)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def png_streams(result: SimResult, costs: CostModel, worker: int, path: str) -> None:
    """One worker's iteration on its two streams, compute and all-to-all: each action's parts
    (``CostModel.part_order``, timed by ``parts.timeline`` from the action's start), coloured by
    micro-batch, a halved action's second half lighter; what overlap hides is the all-to-all drawn
    beside compute."""
    import matplotlib  # here, not at the top: 2 s to import with pyplot, and only a PNG selects Agg

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    s, rows = result.schedule, {moe.COMPUTE: 0, moe.COMM: 1}
    fig, ax = plt.subplots(figsize=(min(24, 4 + result.makespan * 0.9), 2.4))
    for e in (e for e in result.events if e.worker == worker):
        mbs = {("F" if a.op is Op.FORWARD else "B"): a for a in parts(e.action)}
        for part, start, end in moe.timeline(costs.part_order(s, e.action), costs.contention):
            if end <= start:
                continue
            a = mbs.get(part.role, next(iter(mbs.values())))
            colour = _COLOURS[a.mb % len(_COLOURS)][0 if part.role == "F" else 1]
            scale = s.microbatch_scale
            ax.add_patch(Rectangle((e.start + start * scale, rows[part.stream] + (0.45 if part.half == 1 else 0)),
                                   (end - start) * scale, 0.45 if part.half >= 0 else 0.9, facecolor=colour,
                                   edgecolor="#333333", linewidth=0.4, alpha=0.6 if part.half == 1 else 1.0))
        ax.text((e.start + e.end) / 2, -0.15, str(e.action), ha="center", va="bottom", fontsize=6, rotation=30)
    ax.set_xlim(0, result.makespan)
    ax.set_ylim(2, -0.6)
    ax.set_yticks([0.45, 1.45], ["compute", "all-to-all"])
    ax.set_xlabel("time")
    ax.set_title(f"{_title(result)} | worker {worker}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def perfetto_trace(result: SimResult, us_per_unit: float = 1000.0) -> dict:
    """Chrome trace-event JSON (open in ui.perfetto.dev or chrome://tracing): per worker one thread for
    compute, one for gradient reductions and, for a lowered schedule, one for p2p transfers (each named
    by its action: direction, message, peer and group). One time unit = ``us_per_unit`` microseconds."""
    events = []
    for w in range(result.schedule.num_workers):
        for offset, name in enumerate(("", " grad sync", " p2p")):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 3 * w + offset,
                           "args": {"name": f"worker {w}{name}"}})
    for kind, items, offset in (("compute", result.events, 0), ("sync", result.reductions, 1),
                                ("p2p", result.transfers, 2)):
        for e in items:
            a = e.action
            events.append({"ph": "X", "name": str(a), "cat": kind, "pid": 0, "tid": 3 * e.worker + offset,
                           "ts": e.start * us_per_unit, "dur": (e.end - e.start) * us_per_unit,
                           "args": a.to_json()})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": _title(result)}}


def write_picture(result: SimResult, path: str) -> None:
    """Write by extension: .png, .svg, or .json (Perfetto trace)."""
    if path.endswith(".png"):
        png_timeline(result, path)
    elif path.endswith(".svg"):
        with open(path, "w") as f:
            f.write(svg_timeline(result))
    elif path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(perfetto_trace(result), f)
    else:
        raise ConfigError("--out", path, "must end in .png, .svg or .json (Perfetto trace)")
