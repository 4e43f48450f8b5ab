"""pretrain_gpt.py's command line is Megatron-LM's: its own ``parse_args`` and ``validate_args``, with
Chimera's group (``chimera_schedules.tools.options``) added as Megatron-LM's extra arguments.

Every Megatron-LM flag is held to its class in ``flag_classes``: a refused flag given a value other
than Megatron-LM's default, or an honoured one given a value we do not run, fails in one line before
anything starts. ``--help`` prints every flag with its class (Megatron-LM 0.19.2's own ``--help``
crashes on a stray ``%`` in a help string; ours escapes it).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
from megatron.training import arguments as megatron_arguments

from chimera_schedules import ConfigError
from chimera_schedules.tools.options import add_trainer_group

from .flag_classes import VALUES, flag_class
from .refusal import say_once
from .schedule_request import MEGATRON_SCHEDULES

PROG = "pretrain_gpt.py"
# Megatron-LM flags whose values we take from a wider type: every value Megatron-LM takes means the
# same; a fraction of a minute bounds a wait in seconds (how the fault tests see a silent rank quickly).
WIDER = {"--distributed-timeout-minutes": float}


def fail(line: str):
    """Exit 2 on every rank, printing the line once (rank 0) before any rank exits (refusal.py), as
    Megatron-LM prints."""
    say_once(line)
    raise SystemExit(2)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Megatron-LM's parse_args over ``argv`` (default: the command line), and the parser it built."""
    parsers = []

    def extra_args_provider(parser):
        parsers.append(parser)
        return _with_chimera(parser)

    saved = sys.argv
    sys.argv = [PROG] + (list(argv) if argv is not None else saved[1:])
    if any(a.split("=", 1)[0] == "--yaml-cfg" for a in sys.argv):  # Megatron-LM reads it while parsing
        sys.argv = saved
        fail(f"{PROG}: error: --yaml-cfg: {flag_class('--yaml-cfg')[1]}")
    try:
        args = megatron_arguments.parse_args(extra_args_provider)
    except RuntimeError as e:  # --enable-msc without its package, as Megatron-LM words it
        fail(f"{PROG}: error: {e}")
    finally:
        sys.argv = saved
    return args, parsers[0]


def build_parser() -> argparse.ArgumentParser:
    """The parser ``parse`` parses with, built as Megatron-LM's parse_args builds it (for tools and tests)."""
    return _with_chimera(megatron_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def _with_chimera(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.prog = PROG
    parser.description = "GPT pretraining with Megatron-LM's flags, and Chimera and baseline pipeline schedules."
    parser.error = lambda message: fail(f"{PROG}: error: {message}")
    for action in parser._actions:
        _annotate(action)
        if action.option_strings and _long(action) in WIDER:
            action.type = WIDER[_long(action)]
            action.help += " [here: fractions of a minute too]"
    return add_trainer_group(parser, MEGATRON_SCHEDULES)


def _annotate(action: argparse.Action) -> None:
    """Escape a stray ``%`` in Megatron-LM's help text and add the flag's class to it; the flags it
    hides (deprecated spellings) are listed too, since they parse."""
    if not action.option_strings:
        return
    text = "deprecated; Megatron-LM hides it" if action.help == argparse.SUPPRESS else action.help or ""
    try:
        text % dict(vars(action), prog=PROG)
    except (ValueError, TypeError, KeyError):
        text = text.replace("%", "%%")
    kind, reason = flag_class(_long(action))
    if kind != "honoured":
        text += f" [{kind} here: {reason}]"
    elif _long(action) in VALUES:
        text += f" [honoured here for {', '.join(str(v) for v in VALUES[_long(action)] if v)} only]"
    action.help = text


def _long(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def enforce_classes(args, parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """A refused Megatron-LM flag away from its default, or an honoured one outside ``VALUES``,
    fails with one line naming the flag as the user typed it. Returns the flags given away from their
    defaults that have no effect here, each as ``--flag=value (reason)``, for ``say_no_effect``."""
    defaults = vars(parser.parse_known_args([])[0])  # what each dest holds when no flag sets it
    ignored = {}
    for action in parser._actions:
        if not action.option_strings or not hasattr(args, action.dest):
            continue
        try:
            kind, reason = flag_class(_long(action))
        except KeyError:
            continue  # Chimera's own group
        value = getattr(args, action.dest)
        if kind == "refused" and value != defaults[action.dest]:
            fail(f"{PROG}: error: {_typed(action, argv)}={_show(value)}: {reason}")
        if kind == "no effect" and value != defaults[action.dest]:
            ignored.setdefault(action.dest, f"{_typed(action, argv)}={_show(value)} ({reason})")
        allowed = VALUES.get(_long(action))
        values = value if isinstance(value, list) else [value]  # a flag with nargs="+" holds a list
        if allowed and any(v not in allowed for v in values):
            fail(f"{PROG}: error: {_typed(action, argv)}={_show(value)}: {PROG} runs "
                 f"{', '.join(str(v) for v in allowed if v)} only")
    return list(ignored.values())


def say_no_effect(ignored: list[str]) -> None:
    """One startup line (rank 0) naming every given flag that has no effect here, with its reason, so that a
    Megatron-LM user who set one is told (docs/flags.md classes them)."""
    if ignored and int(os.environ.get("RANK", "0")) == 0:
        print(f" > flags with no effect here: {'; '.join(ignored)}", flush=True)


def _typed(action: argparse.Action, argv: list[str]) -> str:
    given = {a.split("=", 1)[0] for a in argv}
    return next((o for o in action.option_strings if o in given), _long(action))


def _show(value) -> str:
    """A value on one line, at most 200 characters."""
    text = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."


class MegatronRefusal(ConfigError):
    """A check of Megatron-LM's validate_args, in its own words (it names no flag of its own): a ConfigError,
    so that --pipeline-schedule auto passes over a candidate it refuses, as over one our rules refuse."""

    def __init__(self, said: str):
        super().__init__("validate_args", said, "")

    def message(self, names) -> str:
        return f"{self.value} (Megatron-LM's validate_args)"


def megatron_validate(args) -> None:
    """Megatron-LM's validate_args: its derived settings (FFN width, kv channels, data-parallel size,
    virtual stages, dtypes, ...) and its checks, an assertion of which becomes one line. The checks of
    --overlap-param-gather-with-optimizer-step (megatron-core's interleaved schedule, the torch format) are
    set aside: it has no effect here (flag_classes), and a configuration moved to Chimera has no virtual stages."""
    asked, grouped = megatron_arguments.get_device_arch_version, args.moe_grouped_gemm
    gather_in_step, args.overlap_param_gather_with_optimizer_step = args.overlap_param_gather_with_optimizer_step, False
    if not torch.cuda.is_available():
        # With TP > 1 it asks the GPU's architecture, to demand CUDA_DEVICE_MAX_CONNECTIONS=1 before
        # Blackwell (10); a CPU has no such limit, so it answers as Blackwell does. With
        # --moe-grouped-gemm it asks the GPU's capability for the grouped kernels, which the CPU
        # replaces by sequential experts (the model builder says so): the check is set aside.
        megatron_arguments.get_device_arch_version = lambda: 10
        args.moe_grouped_gemm = False
    try:
        megatron_arguments.validate_args(args)
    except (AssertionError, ValueError, RuntimeError, TypeError) as e:
        said = " ".join(str(e).split()) or traceback.extract_tb(e.__traceback__)[-1].line  # a bare assert
        raise MegatronRefusal(said) from None
    finally:
        megatron_arguments.get_device_arch_version, args.moe_grouped_gemm = asked, grouped
        args.overlap_param_gather_with_optimizer_step = gather_in_step
