"""One table of schedule options for every front end: the CLI and the trainer add the same options from
it, name their own flags in the same errors, and build the registry's variants the same way."""
import argparse

import pytest

from chimera_schedules import VARIANTS, ConfigError, ScheduleSpec, build, build_spec, check, variant
from chimera_schedules.ir.spec import OPTION, OPTIONS, SHARED, flags
from chimera_schedules.registry import REGISTRY
from chimera_schedules.tools.cli import _options as cli_parser
from chimera_schedules.tools.options import describe
from megatron.chimera.arguments import parse_args
from megatron.chimera.config.parser import build_parser as trainer_parser
from megatron.chimera.config.schedule_request import schedule_flags
from megatron.chimera.testing.plans import plan_of

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag of a parser and of its sub-commands -> its action."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(actions(sub))
        out.update({flag: action for flag in action.option_strings})
    return out


def test_both_front_ends_take_every_option_and_share_choices_defaults_and_help():
    cli, trainer = actions(cli_parser()), actions(trainer_parser())
    for option in OPTIONS:
        assert option.cli in cli and option.trainer in trainer
    for field in SHARED:
        ours, theirs = cli[OPTION[field].cli], trainer[OPTION[field].trainer]
        assert (ours.type, ours.choices, ours.default, ours.help) == \
            (theirs.type, theirs.choices, theirs.default, theirs.help)
        assert ours.default is None and ours.help == describe(field)


def test_an_error_names_each_front_ends_own_flags():
    with pytest.raises(ConfigError) as info:
        build("1f1b", 4, 4, concat="halving")
    assert info.value.option == "concat"
    assert info.value.message(flags("cli")) == "--concat=halving: applies to --schedule chimera only"
    assert info.value.message(flags("trainer")) == \
        "--chimera-concat=halving: applies to --pipeline-schedule chimera only"


def test_check_fills_in_the_defaults_of_the_options_the_schedule_takes():
    assert check(ScheduleSpec("chimera", 4, 4)) == ScheduleSpec("chimera", 4, 4, pipelines=2, concat="direct",
                                                                 order="paper")
    assert check(ScheduleSpec("interleaved", 4, 4)) == ScheduleSpec("interleaved", 4, 4, virtual_stages=2)
    assert check(ScheduleSpec("1f1b", 4, 4)) == ScheduleSpec("1f1b", 4, 4)


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "chimera best"])  # best: seconds of search
def test_the_trainer_builds_each_variant_as_the_library_does(name):
    spec = variant(name, 2, 4)  # global batch 8 / micro-batch 2 = 4 micro-batches on one pipeline
    # the overlap hides an expert-parallel all-to-all: EP=2 over a second replica, twice the global batch
    moe = ["--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall",
           "--expert-model-parallel-size", "2", "--global-batch-size", "16"] if spec.overlap else []
    args = parse_args(MODEL + moe + schedule_flags(spec, num_layers=8), world_size=4 if spec.overlap else 2)
    assert plan_of(args).schedule == build_spec(spec)


@pytest.mark.parametrize("name", [n for n in VARIANTS if "best" not in n])  # best: seconds of search
def test_each_registry_entry_states_what_its_generator_builds(name):
    """What the trainer reads from the registry before a schedule exists (model stages per worker and
    pipeline, copies per worker) is what the generator then builds."""
    spec = check(variant(name, 4, 8))
    entry, schedule = REGISTRY[spec.schedule], build_spec(spec)
    assert (schedule.virtual_stages, schedule.pipelines) == (entry.virtual_stages(spec), entry.pipelines(spec))
    assert {len(schedule.held(w)) for w in range(schedule.depth)} == {entry.chunks_per_worker(spec)}
    splits_itself = ("dualpipe", "dualpipev", "v-min", "v-half", "v-zb")
    assert schedule.split_backward == bool(spec.split_backward) or spec.schedule in splits_itself, name
