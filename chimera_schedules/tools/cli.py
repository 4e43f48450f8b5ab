"""``python -m chimera_schedules``: see, check and cost a pipeline schedule before running it.

Every command takes the same schedule options (or ``--file`` with a schedule in the JSON form), so
``export``, ``stats`` and ``show`` always describe the same schedule. Exit codes: 0 ok, 1 invalid
schedule, 2 bad options or input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..analysis.nccl_model import MODES, check, check_structure
from ..analysis.simulator import simulate
from ..analysis.validator import validate
from ..ir.costs import CostModel, halves_efficiency_at
from ..ir.errors import ConfigError, InvalidSchedule, require
from ..ir.schedule import Schedule
from ..ir.spec import OPTION, SHARED, ScheduleSpec, parse_stage_costs
from ..passes.lowering import lower
from ..registry import SCHEDULES, VARIANTS, build_spec, variant
from . import auto
from .balancer import Sizes, balance, best_megatron, score
from .balancer import per_rank as balancer_per_rank
from .options import add_arguments
from .planner import MODELS, Candidate, ModelShape, Precision, Profile, as_json, even_layout, explain
from .render import ascii_timeline, png_streams, write_picture
from .stage_profile import StageProfile


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        self.exit(2, f"{self.prog}: error: {message}\n")


def _options() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    _schedule_options(common.add_argument_group("schedule"))
    _cost_options(common.add_argument_group("costs (time units are arbitrary; bytes and bytes per unit)"))
    parser = _Parser(prog="python -m chimera_schedules", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    show = sub.add_parser("show", parents=[common], help="ASCII timeline, or a picture with --out")
    show.add_argument("--out", help="write FILE.png, FILE.svg or FILE.json (Perfetto trace) instead")
    show.add_argument("--streams", type=int, metavar="WORKER",
                      help="with --out FILE.png: draw this worker's compute and all-to-all streams part by part")
    stats = sub.add_parser("stats", parents=[common], help="makespan, bubbles, memory per worker")
    stats.add_argument("--json", action="store_true")
    export = sub.add_parser("export", parents=[common], help="the schedule in its JSON form")
    export.add_argument("--out", help="write to this file instead of standard output")
    check = sub.add_parser("validate", parents=[common], help="exit 1 with the reason if invalid")
    check.add_argument("path", nargs="?", metavar="FILE", help="a schedule JSON file (else the options')")
    compare = sub.add_parser("compare", parents=[common], help="every schedule side by side for D and N")
    compare.add_argument("--json", action="store_true")
    _planner_options(sub.add_parser("plan", help="rank layouts (D, W, B, N, schedule) by predicted iteration time"))
    profile = sub.add_parser("profile", help="what a stage-cost profile holds (python -m megatron.chimera.profile "
                             "writes one), by micro-batch size")
    profile.add_argument("path", metavar="FILE")
    return parser


def _schedule_options(g) -> None:
    g.add_argument("--schedule", default="chimera",
                   help=OPTION["schedule"].describe() + f": one of {', '.join(SCHEDULES)} (default chimera)")
    g.add_argument("--stages", "--depth", "-D", dest="depth", type=int, default=4,
                   help=OPTION["depth"].describe() + " (default 4)")
    g.add_argument("--microbatches", "-N", type=int, help=OPTION["microbatches"].describe() + " (default D)")
    add_arguments(g, "cli", ("virtual_stages",) + SHARED + ("overlap",))
    g.add_argument("--file", help="read the schedule from this JSON file instead of generating it")
    g.add_argument("--lowered", action="store_true",
                   help="with its communication: SEND/RECV/ALLREDUCE actions, lowered as the trainer does")
    g.add_argument("--comm", choices=MODES, help="replay the communication under these rules (implies "
                   "--lowered): validate proves it completes (exit 1 names the wait-for cycle), show and "
                   "stats price it")


def _cost_options(c) -> None:
    c.add_argument("--forward-time", type=float, default=1.0, help="forward of one stage (default 1)")
    c.add_argument("--backward-time", type=float, default=2.0, help="backward of one stage (default 2)")
    c.add_argument("--weight-time", type=float,
                   help="the weight-gradient part (W) of --backward-time in a split backward; I is the rest "
                        "(default half of it)")
    c.add_argument("--p2p-latency", type=float, default=0.0)
    c.add_argument("--p2p-bandwidth", type=float, default=float("inf"))
    c.add_argument("--activation-bytes", type=float, default=0.0, help="bytes sent between stages per micro-batch")
    c.add_argument("--allreduce-latency", type=float, default=0.0, help="alpha of the all-reduce model")
    c.add_argument("--allreduce-bandwidth", type=float, default=float("inf"), help="1 / beta")
    c.add_argument("--grad-bytes", type=float, default=0.0, help="gradient bytes of one stage")
    c.add_argument("--data-parallel", type=int, default=1, help="data-parallel width W")
    c.add_argument("--a2a", type=float, default=0.0,
                   help="expert all-to-all time of one stage's forward (dispatch and combine of all its MoE layers); "
                        "a B or I spends it too, an overlapped F&B hides it behind compute (default 0)")
    c.add_argument("--moe-layers", type=int, default=1,
                   help="MoE layers per model stage, sharing its compute and --a2a in an overlapped F&B (default 1)")
    c.add_argument("--halves-efficiency", type=float, default=1.0,
                   help="a half micro-batch computes half as much divided by this (smaller kernels; default 1)")
    c.add_argument("--micro-batch-size", type=int,
                   help="samples per micro-batch: at an odd size a halved action runs the two halves of each "
                        "sequence, priced at --sequence-halves-efficiency (default: an even size, the batch's halves)")
    c.add_argument("--sequence-halves-efficiency", type=float, default=1.0,
                   help="--halves-efficiency of the halves of a sequence (default 1)")
    c.add_argument("--contention", type=float, default=0.0,
                   help="how much slower compute runs beside an all-to-all in an overlapped or halved action "
                        "(0.15: 15%% slower; default 0)")


def _planner_options(planner) -> None:
    planner.add_argument("--workers", type=int, required=True)
    planner.add_argument("--global-batch", type=int, required=True, help="sequences per iteration")
    planner.add_argument("--model", choices=sorted(MODELS),
                         help="a model's shape (the flags below override its fields); else give them all")
    planner.add_argument("--layers", type=int)
    planner.add_argument("--hidden", type=int)
    planner.add_argument("--heads", type=int)
    planner.add_argument("--seq", type=int)
    planner.add_argument("--vocab", type=int, help="default 50257 without --model")
    planner.add_argument("--mtp-layers", type=int, help="multi-token-prediction layers after the last layer")
    planner.add_argument("--profile", required=True, help="hardware profile JSON (see profiles/)")
    planner.add_argument("--stage-profile", metavar="FILE",
                         help="stage costs measured on the devices (python -m megatron.chimera.profile writes them) "
                              "in place of the FLOP count at the profile's rate")
    planner.add_argument("--memory-gb", type=float, help="override the profile's memory per device")
    planner.add_argument("--depths", type=int, nargs="+", help="only these pipeline depths")
    planner.add_argument("--bf16", action="store_true", help="bf16 weights with fp32 main weights (as training's)")
    planner.add_argument("--use-distributed-optimizer", action="store_true",
                         help="main weights and AdamW state sharded over each stage's replica group")
    planner.add_argument("--top", type=int, default=10)
    planner.add_argument("--json", action="store_true")


def _show(args, schedule: Schedule) -> None:
    """The timeline as text, a picture (--out), or one worker's two streams (--streams)."""
    costs = _costs(args)
    result = simulate(schedule, costs, args.comm or "nccl")
    if args.streams is not None:
        require(0 <= args.streams < schedule.num_workers, "--streams", args.streams,
                f"must name a worker, 0 to {schedule.num_workers - 1}")
        require(bool(args.out) and args.out.endswith(".png"), "--out", args.out, "must be FILE.png with --streams")
        png_streams(result, costs, args.streams, args.out)
    elif args.out:
        write_picture(result, args.out)
    else:
        print(ascii_timeline(result))
        return
    print(f"wrote {args.out}")


def _costs(args) -> CostModel:
    for option, value in (("--forward-time", args.forward_time), ("--backward-time", args.backward_time)):
        require(value > 0, option, value, "must be positive")
    if args.weight_time is not None:
        require(0 < args.weight_time < args.backward_time, "--weight-time", args.weight_time,
                f"must be positive and less than --backward-time ({args.backward_time:g}), which includes it")
    require(args.a2a >= 0, "--a2a", args.a2a, "must not be negative")
    require(args.moe_layers >= 1, "--moe-layers", args.moe_layers, "must be at least 1")
    for option, value in (("--halves-efficiency", args.halves_efficiency),
                          ("--sequence-halves-efficiency", args.sequence_halves_efficiency)):
        require(0 < value <= 1, option, value, "must be in (0, 1]")
    require(args.micro_batch_size is None or args.micro_batch_size >= 1, "--micro-batch-size", args.micro_batch_size,
            "must be at least 1")
    require(args.contention >= 0, "--contention", args.contention, "must not be negative")
    forward, backward = args.forward_time, args.backward_time
    if args.stage_costs:  # per model stage, in place of the two above
        try:
            forward, backward = parse_stage_costs(args.stage_costs)
        except ValueError as e:
            raise ConfigError("--stage-costs", args.stage_costs, str(e)) from None
        forward, backward = (forward[0], backward[0]) if len(forward) == 1 else (forward, backward)
    return CostModel(forward, backward, args.p2p_latency, args.p2p_bandwidth,
                     args.activation_bytes, args.allreduce_latency, args.allreduce_bandwidth,
                     args.grad_bytes, args.data_parallel, weight=args.weight_time, a2a=args.a2a,
                     moe_layers=args.moe_layers,
                     halves_efficiency=halves_efficiency_at(args.micro_batch_size, args.halves_efficiency,
                                                            args.sequence_halves_efficiency),
                     contention=args.contention)


def _load(path: str, option: str) -> Schedule:
    try:
        with open(path) as f:
            return Schedule.loads(f.read())
    except OSError as e:
        raise ConfigError(option, path, f"cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(option, path, f"not a schedule: {e}") from None


def _schedule(args) -> Schedule:
    path = getattr(args, "path", None) or args.file
    if path:
        schedule = _load(path, "FILE" if getattr(args, "path", None) else "--file")
        validate(schedule)
        if schedule.lowered:  # a file may hold either kind: a lowered one's communication must be whole too
            check_structure(schedule)
        return schedule
    spec = ScheduleSpec(args.schedule, args.depth, args.microbatches or args.depth, virtual_stages=args.chunks,
                        pipelines=args.pipelines, waves=args.waves, concat=args.concat, order=args.order,
                        split_backward=args.split_backward, overlap=args.overlap,
                        halves=args.no_halves, stage_costs=args.stage_costs)  # --no-halves stores False
    return build_spec(spec, _costs(args))


def _compare(args) -> list[dict]:
    """Every registered variant the sizes allow; ``--chunks`` sets the interleaved one's v."""
    d, n, costs = args.depth, args.microbatches or args.depth, _costs(args)
    rows = []
    for name in VARIANTS:
        spec = variant(name, d, n)
        if spec.virtual_stages and args.chunks:
            spec, name = dataclasses.replace(spec, virtual_stages=args.chunks), f"{spec.schedule} v={args.chunks}"
        try:
            row = simulate(build_spec(spec, costs), costs).stats()
        except ConfigError as e:
            row = {"skipped": str(e)}
        rows.append({**row, "schedule": name})
    return rows


def _shape(args):
    """The model: a --model preset with the given fields replaced, or every field given."""
    given = {field: getattr(args, option) for field, option in _SHAPE_OPTIONS.items()
             if getattr(args, option) is not None}
    if args.model:
        return dataclasses.replace(MODELS[args.model], **given)
    for field in ("layers", "hidden", "heads", "seq"):
        if field not in given:
            raise ConfigError("--" + field, None, "is required without --model")
    return ModelShape(**{"vocab": 50257, **given})


_SHAPE_OPTIONS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "seq": "seq", "vocab": "vocab",
                  "mtp": "mtp_layers"}


def _plan(args) -> int:
    shape = _shape(args)
    for option in ("workers", "global_batch"):
        if getattr(args, option) <= 0:
            raise ConfigError("--" + option.replace("_", "-"), getattr(args, option), "must be positive")
    for field, option in _SHAPE_OPTIONS.items():
        if getattr(shape, field) < (0 if field in ("vocab", "mtp") else 1):
            raise ConfigError("--" + option.replace("_", "-"), getattr(shape, field), "must be positive")
    try:
        profile = Profile.load(args.profile)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError("--profile", args.profile, f"not a readable profile: {e}") from None
    if args.memory_gb:
        profile = dataclasses.replace(profile, memory=args.memory_gb * 2**30)
    precision = Precision(args.bf16, args.use_distributed_optimizer)
    ranked = _ranked(args, shape, profile, precision)
    layout = _balanced_pick(ranked, shape, profile, precision)
    if args.json:
        print(json.dumps({"ranked": as_json(ranked), "layout": layout}, indent=1))
        return 0
    print(explain(ranked, profile))
    if layout:
        print(_layout_lines(layout))
    print(f"\n{'layout':<46}{'s/iter':>9}{'tokens/s':>12}{'bubbles':>9}{'GiB':>7}")
    for c in ranked[:args.top]:
        print(f"{c.label:<46}{c.seconds:9.3f}{c.tokens_per_s:12,.0f}{c.bubble_ratio:9.1%}"
              f"{c.memory / 2**30:7.1f}{'' if c.fits else '  (does not fit)'}")
    return 0


def _ranked(args, shape: ModelShape, profile: Profile, precision: Precision) -> list[Candidate]:
    """Every depth's plans from the planning layer (tools/auto.py, as --pipeline-schedule auto ranks them), fastest
    first, those over the profile's memory last."""
    measured = _stage_profile(args.stage_profile) if args.stage_profile else None
    found = []
    for d in args.depths or [d for d in range(2, args.workers + 1) if args.workers % d == 0]:
        w = args.workers // d
        request = auto.Request(shape, profile, d, w, args.global_batch, (1, 2, 4, 8), profile.memory, precision,
                               balance=False, priced=measured.priced(shape, profile, d, w) if measured else None)
        try:
            found += auto.ranked(request)
        except ConfigError:
            continue  # no planned schedule takes this depth and batch
    return sorted(found, key=lambda c: (not c.fits, c.seconds))


def _stage_profile(path: str) -> StageProfile:
    try:
        return StageProfile.load(path)
    except (OSError, ValueError) as e:
        raise ConfigError("--stage-profile", path, f"not a readable stage-cost profile: {e}") from None


def _profile(args) -> int:
    """The parts a stage-cost profile holds, in ms, by micro-batch size."""
    try:
        measured = StageProfile.load(args.path)
    except (OSError, ValueError) as e:
        raise ConfigError("profile", args.path, f"not a readable stage-cost profile: {e}") from None
    print(f"{measured.name}: {measured.source}")
    for b in sorted(measured.times):
        print(f"  micro-batch size {b} (ms forward/backward): {measured.describe(b)}")
    return 0


def _balanced_pick(ranked, shape, profile, precision) -> dict | None:
    """The balancer's stages for the pick, beside the even split and Megatron-LM's best hand option."""
    pick = next((c for c in ranked if c.fits), None)
    if pick is None:
        return None
    schedule = build_spec(variant(pick.schedule, pick.depth, pick.microbatches))
    sizes = Sizes(pick.micro_batch, pick.width, pick.expert_parallel, precision)
    per_rank = balancer_per_rank(schedule)
    even = score(shape, profile, schedule, even_layout(shape, schedule.stages_per_pipeline), sizes)
    balanced = balance(shape, profile, schedule, sizes, per_rank)
    try:
        hand = best_megatron(shape, profile, schedule, sizes, per_rank)
        megatron = {"layout": str(hand.layout), "flags": hand.flags, "seconds": hand.seconds}
    except ConfigError:
        megatron = None
    return {"for": pick.label, "layout": str(balanced.layout), "seconds": balanced.seconds,
            "even": {"layout": str(even.layout), "seconds": even.seconds}, "megatron": megatron}


def _layout_lines(layout: dict) -> str:
    even, hand = layout["even"], layout["megatron"]
    gain = even["seconds"] / layout["seconds"] - 1
    lines = [f"  stages for {layout['for']}: {layout['layout']}, {layout['seconds']:.3f} s/iteration, "
             f"{gain:.1%} faster than the even split ({even['layout']}, {even['seconds']:.3f} s)",
             f"    train with: --pipeline-model-parallel-layout '{layout['layout']}'"]
    if hand:
        lines.append(f"    Megatron-LM's best hand option: {hand['flags'] or 'the even split'} "
                     f"({hand['layout']}, {hand['seconds']:.3f} s)")
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    peak = max([len(str(r.get("peak_activations", ""))) for r in rows] + [24]) + 2
    lines = [f"{'schedule':<22}{'makespan':>9}{'bubble':>8}  {'peak activations (M_a)':<{peak}}weights (M_theta)"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['schedule']:<22}  skipped: {r['skipped']}")
        else:
            lines.append(f"{r['schedule']:<22}{r['makespan']:>9}{r['bubble_ratio']:>8.3f}  "
                         f"{str(r['peak_activations']):<{peak}}{r['weight_units']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _options().parse_args(argv)
    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "profile":
            return _profile(args)
        if args.command == "compare":
            rows = _compare(args)
            print(json.dumps(rows, indent=1) if args.json else _table(rows))
            return 0
        schedule = _schedule(args)
        if args.lowered or args.comm:
            schedule = lower(schedule)
        if args.command == "validate" and args.comm:
            check(schedule, args.comm)
            print(f"proven: {schedule.name}, {schedule.num_workers} workers, {sum(map(len, schedule.workers))} "
                  f"operations, every one completes under {args.comm}'s rules")
        elif args.command == "validate":
            print(f"valid: {schedule.name}, {schedule.num_workers} workers, "
                  f"{sum(map(len, schedule.workers))} actions")
        elif args.command == "export":
            text = schedule.dumps()
            if args.out:
                with open(args.out, "w") as f:
                    f.write(text + "\n")
            else:
                print(text)
        elif args.command == "stats":
            stats = simulate(schedule, _costs(args), args.comm or "nccl").stats()
            print(json.dumps(stats, indent=1) if args.json else _table([stats]))
        else:
            _show(args, schedule)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except InvalidSchedule as e:
        print(f"invalid schedule: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f"--out={e.filename}" if e.filename else "output"
        print(f"error: {where}: cannot write: {e.strerror}", file=sys.stderr)
        return 2
    return 0
