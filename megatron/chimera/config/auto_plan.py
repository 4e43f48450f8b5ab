"""--pipeline-schedule auto: the planning layer (chimera_schedules.tools.auto) picks the schedule, its options,
the layout and the micro-batch size for the model, sizes and batch that the other flags give, under a memory
limit; this module turns the run's flags into its request and its pick into flags.

The pick is a set of flags (` > pipeline plan: ...`). They replace `--pipeline-schedule auto` and the
planning flags in the command line before it is parsed for real, so an auto run is exactly the run of
the printed flags: the same namespace, so the same run to the bit. Every rank plans from the same
command line and profile, so every rank picks the same plan (and the ranks still agree on the
schedule's hash before iteration 1: distributed/schedule_agreement.py).

Costs: Megatron-LM's FLOP count at a hardware profile's rate (``--pipeline-profile``, a JSON path or
a name in profiles/; by default the CPU profile on the CPU, the H100 datasheet on a GPU). Memory: the
planner's peak per worker against ``--pipeline-memory-limit-gb``, by default the profile's memory
less a tenth (allocator slack and buffers the model does not count).

Candidates (tools/auto.py): every planned variant of the registry, at the given pipeline depth, data-parallel
width and expert parallelism, at each micro-batch size that divides the batch (only the given one with an
explicit --micro-batch-size), and the fastest under the balancer's layout unless the user gave a layout. A
candidate the trainer's own rules refuse is passed over, by the same validation a run gets.

Resume: the plan's flags are saved with the checkpoint's args (``pipeline_plan``). A run resumed from it
(``--load``) keeps them, unless ``--pipeline-replan`` asks for a new plan or the trainer's rules now refuse
them (another world size, say): then it plans again and says why.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import time
from collections.abc import Callable

import torch

from chimera_schedules import ConfigError
from chimera_schedules.ir.costs import CostModel
from chimera_schedules.ir.errors import require
from chimera_schedules.ir.spec import OPTION, spell_stage_costs
from chimera_schedules.ir.spec import flags as spelled
from chimera_schedules.registry import VARIANTS
from chimera_schedules.tools import auto
from chimera_schedules.tools.planner import Candidate, Precision, Profile
from chimera_schedules.tools.stage_profile import StageProfile

from .balanced_layout import HAND_FLAGS, model_shape, profile_path

AUTO = "auto"
PROFILE_FLAG, LIMIT_FLAG, REPLAN_FLAG = "--pipeline-profile", "--pipeline-memory-limit-gb", "--pipeline-replan"
PLANNING = (PROFILE_FLAG, LIMIT_FLAG, REPLAN_FLAG)
HEADROOM = 0.9  # of the device's memory, when no limit is given
# the flags the plan sets: given with auto, they are refused (the planner chooses them)
CHOSEN = ("--chimera-pipelines", "--hanayo-waves", "--chimera-concat", "--chimera-order", "--split-backward",
          "--overlap-moe-expert-parallel-comm", "--no-overlap-moe-halves", "--num-layers-per-virtual-pipeline-stage",
          "--pipeline-stage-costs")
SHOWN = 5  # plans in the startup table
PROFILE_FILE = "pipeline_profile.json"  # the startup measurement, written into --save: --pipeline-profile reads it
Measure = Callable[[argparse.Namespace, list[int]], StageProfile]


@dataclasses.dataclass(frozen=True)
class Pick:
    """The plan auto chose: its flags, the ranked candidates and the table that explains the choice."""
    flags: list[str]
    ranked: list[Candidate]
    table: str


def asks_auto(argv: list[str]) -> bool:
    """Whether the command line gives --pipeline-schedule auto (either spelling)."""
    for i, a in enumerate(argv):
        if a == "--pipeline-schedule=auto" or (a == "--pipeline-schedule" and argv[i + 1:i + 2] == [AUTO]):
            return True
    return False


def given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def without(argv: list[str], flags: tuple[str, ...], valued: bool = True, values: int = 1) -> list[str]:
    """``argv`` less ``flags`` (and each one's ``values`` values when ``valued``, unless given as flag=value)."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = values if valued and "=" not in a else 0
            continue
        out.append(a)
    return out


def value(argv: list[str], flag: str) -> str | None:
    """The last value given to ``flag`` (as argparse keeps it), or None."""
    found = None
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            found = a.split("=", 1)[1]
        elif a == flag and i + 1 < len(argv):
            found = argv[i + 1]
    return found


def check_planning_flags(argv: list[str]) -> None:
    """The planning flags apply with --pipeline-schedule auto only."""
    if not asks_auto(argv):
        for flag in PLANNING:
            require(not given(argv, flag), flag, True, "applies with --pipeline-schedule auto only")


def base_argv(argv: list[str]) -> list[str]:
    """The user's command line without auto and the planning flags: the flags the plan adds to."""
    return without(without(argv, ("--pipeline-schedule", PROFILE_FLAG, LIMIT_FLAG)), (REPLAN_FLAG,), valued=False)


def planned_argv(argv: list[str], validated: Callable[[list[str]], argparse.Namespace],
                 saved_plan: Callable[[str], tuple[list[str], int] | None],
                 measure: Measure | None = None) -> tuple[list[str], list[str]]:
    """The command line with auto replaced by the plan's flags, and those flags; prints the plan on rank 0.
    ``validated(argv)`` parses and validates a command line quietly (ConfigError on a refused one);
    ``saved_plan(load)`` is the plan the checkpoint at ``load`` was trained with and its iteration, if any;
    ``measure(run, sizes)`` measures the stage costs on this run's devices (stage_costs.py), when no
    --pipeline-profile is given."""
    for flag in CHOSEN:
        require(not given(argv, flag), flag, True, "is chosen by --pipeline-schedule auto: give a schedule instead "
                "to set it")
    start = time.perf_counter()
    base = base_argv(argv)
    kept, why = _kept_plan(argv, base, validated, saved_plan)
    if kept is not None:
        _say(f" > pipeline plan: {' '.join(kept)} ({why})")
        return base + kept, kept
    micro_batch_given = given(argv, "--micro-batch-size")
    batch = [] if micro_batch_given else ["--micro-batch-size", "1"]
    probe = validated(base + ["--pipeline-schedule", "1f1b"] + batch + _planning_flags(argv))  # sizes, model
    pick = choose(base, probe, micro_batch_given, validated, measure)
    _say(pick.table + (f"\n   {why}" if why else ""))
    _say(f" > pipeline plan: {' '.join(pick.flags)} (planned in {time.perf_counter() - start:.2f} s)")
    return base + pick.flags, pick.flags


def _kept_plan(argv: list[str], base: list[str], validated, saved_plan) -> tuple[list[str] | None, str]:
    """The plan of the checkpoint at --load and the words that say so; or None, and why a plan it held is
    not kept ('' when there is none to keep)."""
    load = value(argv, "--load")
    saved = saved_plan(load) if load else None
    if saved is None:
        return None, ""
    flags, iteration = saved
    if given(argv, REPLAN_FLAG):
        return None, f"planned again ({REPLAN_FLAG}), not kept from the checkpoint at iteration {iteration}"
    if given(argv, "--micro-batch-size"):  # the user's own batch size wins over the saved plan's
        flags = without(flags, ("--micro-batch-size",))
    try:
        validated(base + flags)
    except ConfigError as e:
        refused = e.message(spelled("trainer"))
        return None, f"the plan of the checkpoint at iteration {iteration} is refused now ({refused}); planned again"
    return flags, f"kept from the checkpoint at iteration {iteration} in {load}; {REPLAN_FLAG} plans again"


def _say(text: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(text, flush=True)


def _planning_flags(argv: list[str]) -> list[str]:
    """The planning flags as given, kept for the probe's parse (where they are read)."""
    out = []
    for i, a in enumerate(argv):
        name = a.split("=", 1)[0]
        if name in (PROFILE_FLAG, LIMIT_FLAG):
            out += [a] if "=" in a else [a, argv[i + 1]]
    return out


def choose(base: list[str], args, micro_batch_given: bool, validated, measure: Measure | None = None) -> Pick:
    """Rank the candidates by predicted iteration time; the first that fits the memory limit and that the
    trainer's rules accept wins. Refuses in one line when none fits."""
    profile, source = _profile(args)
    request = _request(args, profile, micro_batch_given, balance=not any(given(base, flag) for flag, _ in HAND_FLAGS))
    stages, source = _stage_costs(args, request, measure, source)
    if stages is not None:
        shards = args.tensor_model_parallel_size * args.context_parallel_size
        request = dataclasses.replace(request, priced=stages.priced(
            request.shape, profile, request.depth, request.width, request.expert_parallel, shards))
    ranked = auto.ranked(request)
    fitting = [c for c in ranked if auto.fits_in(c, request)]
    if not fitting:
        smallest = min(ranked, key=lambda c: c.memory)
        flag = LIMIT_FLAG if args.pipeline_memory_limit_gb else PROFILE_FLAG
        value = args.pipeline_memory_limit_gb or profile.name
        raise ConfigError(flag, value, f"no pipeline plan fits in {request.limit / 2**30:.4g} GiB per worker: the "
                                       f"smallest, {smallest.label}, needs {smallest.memory / 2**30:.4g} GiB")
    for c in fitting:
        flags = plan_flags(c, args, micro_batch_given, auto.stage_costs(request, c))
        try:
            validated(base + flags)
        except ConfigError:
            continue  # a rule of the trainer's refuses it (Transformer Engine, recomputation, ...)
        parts = f"\n   {_parts_line(stages, c.micro_batch)}" if stages is not None else ""
        return Pick(flags, ranked, _table(ranked, c, request.limit, source, len(ranked) - len(fitting)) + parts)
    raise ConfigError("--pipeline-schedule", AUTO, "the trainer's rules refuse every plan that fits in memory")


def ranking(args) -> list[Candidate]:
    """Every plan for the run the namespace ``args`` describes, fastest predicted first, priced by the FLOP count
    at its hardware profile, at the even split: what a startup table shows the top of (benchmarks read it)."""
    profile, _ = _profile(args)
    return auto.ranked(_request(args, profile, micro_batch_given=False, balance=False))


def _request(args, profile: Profile, micro_batch_given: bool, balance: bool) -> auto.Request:
    """The planning layer's request for this run: its sizes, precision and experts as the flags give them (the
    user's layout stays theirs: no balancing when they gave one)."""
    w, ep = args.data_parallel_size, args.expert_model_parallel_size
    return auto.Request(
        model_shape(args), profile, args.pipeline_model_parallel_size, w, args.global_batch_size,
        (args.micro_batch_size,) if micro_batch_given else (1, 2, 4, 8), _limit(args, profile),
        Precision(args.bf16 or args.fp16, args.use_distributed_optimizer, muon=args.optimizer == "muon"),
        expert_parallel=ep if w % ep == 0 else 1,  # the planner spreads experts over the data-parallel ranks only
        context_parallel=args.context_parallel_size,
        overlap=bool(args.num_experts and ep > 1 and args.moe_token_dispatcher_type == "alltoall"),
        balance=balance)


def plan_flags(c: Candidate, args, micro_batch_given: bool, priced: CostModel) -> list[str]:
    """The trainer's flags for one candidate: its schedule, the options its variant sets, the stage costs it was
    predicted at (in ms: the trainer builds the orders that depend on them at these), its micro-batch size."""
    fields = dict(VARIANTS[c.schedule])
    flags = ["--pipeline-schedule", fields.pop("schedule")]
    for field, value in fields.items():
        flag = OPTION[field].trainer
        if field == "virtual_stages":
            flags += [flag, str(args.num_layers // (c.depth * value))]
        elif OPTION[field].type is bool:
            flags += [flag] if value else []
        else:
            flags += [flag, str(value)]
    flags += ["--pipeline-model-parallel-layout", c.layout] if isinstance(c, auto.Balanced) else []
    if c.depth > 1:
        ms = [[1e3 * t for t in times] for times in (priced.forward, priced.backward)]
        flags += [OPTION["stage_costs"].trainer, spell_stage_costs(*ms)]
    return flags + ([] if micro_batch_given else ["--micro-batch-size", str(c.micro_batch)])


def _stage_costs(args, request: auto.Request, measure: Measure | None, source: str) -> tuple[StageProfile | None, str]:
    """The measured stage costs to plan with, and the words for the table: a stage-cost file given as
    --pipeline-profile, else a measurement on this run's devices (when ``measure`` is given and no hardware
    profile was named); None where the FLOP count prices the stages."""
    if args.pipeline_profile and _holds_stage_costs(args.pipeline_profile):
        path = profile_path(args.pipeline_profile)
        try:
            stages = StageProfile.load(path)
        except ValueError as e:
            raise ConfigError(PROFILE_FLAG, args.pipeline_profile, str(e)) from None
        return stages, f"stage costs from {path} (measured on {stages.source}); communication: {source.split(',')[0]}"
    if args.pipeline_profile or measure is None:
        return None, source
    sizes = [b for b in request.micro_batches if request.global_batch % (request.width * b) == 0]
    stages = measure(args, sizes)
    if args.save and int(os.environ.get("RANK", "0")) == 0:  # a later run may plan from it: --pipeline-profile
        os.makedirs(args.save, exist_ok=True)
        stages.save(os.path.join(args.save, PROFILE_FILE))
    return stages, f"stage costs measured at startup on {stages.source}; communication: {source.split(',')[0]}"


def _holds_stage_costs(name: str) -> bool:
    path = profile_path(name)
    require(os.path.isfile(path), PROFILE_FLAG, name, "no such profile (a JSON file, or a name in profiles/)")
    return StageProfile.holds(path)


def _parts_line(stages: StageProfile, b: int) -> str:
    return f"stage parts (ms forward/backward, micro-batch size {b}, one device): {stages.describe(b)}"


def _profile(args) -> tuple[Profile, str]:
    """The hardware profile the costs come from, and how it was chosen. Tensor and context parallelism
    split each stage's work over their ranks: the profile's rate is theirs together. A stage-cost file
    given as --pipeline-profile leaves this device's default for the rest (communication, memory)."""
    name = args.pipeline_profile or ""
    if not name or _holds_stage_costs(name):
        name = "h100-datasheet" if torch.cuda.is_available() else "cpu-this-machine"
    path = profile_path(name)
    require(os.path.isfile(path), PROFILE_FLAG, name, "no such profile (a JSON file, or a name in profiles/)")
    profile = Profile.load(path)
    ranks = args.tensor_model_parallel_size * args.context_parallel_size
    how = "given" if name == args.pipeline_profile else "this device's default"
    return dataclasses.replace(profile, flops=profile.flops * ranks), f"profile {profile.name} ({how}), " \
                                                                      "Megatron-LM's FLOP count"


def _limit(args, profile: Profile) -> float:
    if args.pipeline_memory_limit_gb is not None:
        require(args.pipeline_memory_limit_gb > 0, LIMIT_FLAG, args.pipeline_memory_limit_gb, "must be positive")
        return args.pipeline_memory_limit_gb * 2**30
    if torch.cuda.is_available():
        return HEADROOM * torch.cuda.get_device_properties(0).total_memory
    return HEADROOM * profile.memory


def _table(ranked: list[Candidate], pick: Candidate, limit: float, source: str, over: int) -> str:
    """The startup table: the best plans with their predictions, and why the pick won."""
    lines = [f" > pipeline plans (--pipeline-schedule auto; costs: {source}; memory limit {limit / 2**30:.4g} GiB "
             "per worker):",
             f"   {'plan':<52} {'ms/iteration':>12} {'bubble':>7} {'peak GiB/worker':>16}"]
    for c in ranked[:SHOWN]:
        mark = "*" if c is pick else " " if c.memory <= limit else "x"
        lines.append(f" {mark} {c.label:<52} {1e3 * c.seconds:>12.4g} {c.bubble_ratio:>7.1%} "
                     f"{c.memory / 2**30:>16.4g}")
    rivals = [c for c in ranked if c is not pick and c.memory <= limit]
    why = f"fastest predicted of {len(ranked) - over} plans that fit ({over} over the limit, marked x)"
    if rivals:
        why += f"; the next, {rivals[0].label}, is {rivals[0].seconds / pick.seconds:.3f}x its time"
    return "\n".join(lines + [f"   the pick (*): {why}"])


def quietly(run: Callable[[], argparse.Namespace]) -> argparse.Namespace:
    """Run a planning parse without its printing (Megatron-LM's argument table): only the real parse prints."""
    with contextlib.redirect_stdout(io.StringIO()):
        return run()
