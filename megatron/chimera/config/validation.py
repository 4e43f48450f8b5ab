"""pretrain_gpt.py's checks of what the flags ask for, after Megatron-LM's parser (parser.py), in the order
they run.

Everything that can be known before a process group exists is checked, so that an impossible layout fails
at once with one line naming the flag and the rule (``parse_args`` prints it and exits with code 2). Our
rules run before Megatron-LM's ``validate_args``, so a layout error names the flag; the checks that need its
derived settings (FFN width, query groups) and the checkpoint's run after it. What the rules ask of the
layers above config (the tokenizer, Transformer Engine, the checkpoint) comes in as ``probes``.

The namespace keeps what Megatron-LM's own functions read: its derived fields, set as its validate_args sets
them (the data-parallel size, the global batch, the expert TP size, the padded vocabulary, ...), and the
layout --balance-pipeline-layout picks, as its --pipeline-model-parallel-layout. What only our code reads is
derived again when the typed sections are built (job.py): the resolved schedule, the micro-batches, the
model stages, a first launch.
"""
from __future__ import annotations

import argparse

from .architecture_rules import check_architecture
from .batch_ramp import check_other_batches, check_ramp
from .checkpoint_spec import first_launch
from .layer_probes import LayerProbes
from .lr_schedule import check_training_length
from .megatron_namespace import read_megatron_spellings, validate_args_as_given
from .parallel_rules import check_expert_layout, check_optimizer_instances, check_sizes
from .parser import enforce_classes
from .resume_rules import check_resume, take_checkpoint_args
from .run_rules import check_muon, check_run, check_series
from .schedule_rules import check_schedule
from .tokenizer_rules import check_tokenizer


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str], world_size: int | None,
             probes: LayerProbes) -> list[str]:
    """Raises ConfigError naming the first flag that breaks a rule. ``argv``: the flags as typed (a refused
    flag is named as the user spelled it); ``world_size``: the launcher's, else --world-size. Returns the
    given flags that have no effect here, each with its reason (``enforce_classes``)."""
    args.world_size = world_size or args.world_size
    if args.use_checkpoint_args:
        take_checkpoint_args(args, probes)
    ignored = enforce_classes(args, parser, argv)
    check_ramp(args)
    check_sizes(args)
    check_expert_layout(args)
    check_optimizer_instances(args)
    check_muon(args)
    check_training_length(args)
    read_megatron_spellings(args)
    check_run(args)
    check_series(args)
    check_tokenizer(args, probes.build_tokenizer)
    check_schedule(args, probes.transformer_engine)
    check_other_batches(args, lambda at: check_schedule(at, probes.transformer_engine))
    validate_args_as_given(args)
    check_architecture(args, probes.transformer_engine)
    if args.load and not first_launch(args):
        check_resume(args, probes)
    return ignored
