"""--use-checkpoint-args, and a resume from --load: what the checkpoint there must hold for this run. The
checkpoint layer reads it (layer_probes.py: each file vouched for before anything in it is unpickled);
the rules on what it holds are the flags'."""
from __future__ import annotations

from chimera_schedules.ir.errors import require

from .layer_probes import LayerProbes
from .lr_schedule import check_resumed_schedule


def take_checkpoint_args(args, probes: LayerProbes) -> None:
    """--use-checkpoint-args, as Megatron-LM's parse_and_validate_args: before any check (so a setting taken
    that we refuse fails as if given), Megatron-LM's load_args_from_checkpoint takes the model's settings, and
    the tokenizer's unless --no-use-tokenizer-model-from-checkpoint-args, from the args the --load checkpoint
    saved, once our manifest vouches for the file they are read from. Without a checkpoint there yet (a first
    launch), it says so and the flags stay as given, as in Megatron-LM."""
    require(args.load is not None, "--use-checkpoint-args", True, "needs --load (Megatron-LM's rule)")
    probes.take_checkpoint_args(args.load, args)


def check_resume(args, probes: LayerProbes) -> None:
    """--load must hold a whole checkpoint of this model's shape (sizes and common state only), with the
    optimizer state and LR schedule a resume loads, unless --finetune or --no-load-optim say it loads none."""
    saved = probes.read_checkpoint(args.load, args, args.verify_integrity)
    require(saved.unverifiable is None, "--verify-integrity", True, saved.unverifiable)
    loads_optimizer = not (args.finetune or args.no_load_optim)
    require(not loads_optimizer or "optimizer" in saved.common, "--load", args.load,
            "holds no optimizer state (a model saved alone?): pass --no-load-optim or --finetune")
    if saved.format == "torch" and loads_optimizer:
        _check_legacy_optimizer(args, saved.common.get("args"))
    saved_optimizer = getattr(saved.common.get("args"), "optimizer", args.optimizer)
    require(not loads_optimizer or saved_optimizer == args.optimizer, "--optimizer", args.optimizer,
            f"the checkpoint in {args.load} holds {saved_optimizer}'s optimizer state: pass --no-load-optim or "
            "--finetune to start this optimizer afresh")
    if loads_optimizer and "opt_param_scheduler" in saved.common:
        check_resumed_schedule(args, saved.common["opt_param_scheduler"])


def _check_legacy_optimizer(args, saved) -> None:
    """A legacy torch checkpoint's optimizer state (checkpoint/legacy.py) loads as AdamW's, into the tensor- and
    pipeline-parallel sizes and the precision it was saved with (``saved``: its args)."""
    require(args.optimizer == "adam", "--optimizer", args.optimizer,
            f"the torch checkpoint in {args.load} holds Megatron-LM's AdamW state: pass --no-load-optim or --finetune")
    for flag, key in (("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                      ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
                      ("--bf16", "bf16"), ("--fp16", "fp16")):
        value = getattr(saved, key, getattr(args, key))
        require(value == getattr(args, key), flag, getattr(args, key),
                f"the torch checkpoint in {args.load} was saved with {flag} {value}, and its optimizer state loads "
                "with the same: pass --no-load-optim or --finetune to start it afresh")
