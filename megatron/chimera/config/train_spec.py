"""Training: batches, iterations, learning rate schedule, optimizer, precision, evaluation and exit policy."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from megatron.core.optimizer.optimizer_config import OptimizerConfig

from .arguments import lr_increment, lr_schedule


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW, or with --optimizer muon (``name``) Muon for the hidden weight matrices (``muon``: the --muon-*
    settings by megatron-core's OptimizerConfig field names), and the LR schedule. ``schedule``:
    megatron-core's OptimizerParamScheduler settings (arguments.lr_schedule), stepped by ``lr_increment``
    per iteration (the global batch with --train-samples, else 1). ``decoupled_lr``/``decoupled_min_lr``:
    the input embedding's and output layer's own schedule (--decoupled-lr; the min defaults to --min-lr)."""

    lr: float
    min_lr: float
    lr_warmup_init: float
    schedule: dict
    lr_increment: int
    override_scheduler: bool
    use_checkpoint_scheduler: bool
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    decoupled_lr: float | None
    decoupled_min_lr: float | None
    clip_grad: float
    distributed: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    apply_wd_to_qk_layernorm: bool  # validate_args sets it for --no-weight-decay-cond-type too
    name: str = "adam"
    muon: dict | None = None
    layer_wise: bool = False  # --use-distributed-optimizer with Muon (validate_args renames it so)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OptimizerSpec:
        decoupled_min = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        return cls(args.lr, args.min_lr, args.lr_warmup_init, lr_schedule(args), lr_increment(args),
                   args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler, args.weight_decay,
                   (args.adam_beta1, args.adam_beta2), args.adam_eps, args.decoupled_lr, decoupled_min,
                   args.clip_grad, args.use_distributed_optimizer, args.overlap_grad_reduce,
                   args.overlap_param_gather, args.apply_wd_to_qk_layernorm, args.optimizer, muon_settings(args),
                   getattr(args, "use_layer_wise_distributed_optimizer", False))


def muon_settings(args: argparse.Namespace) -> dict:
    """The --muon-* flags as megatron-core's OptimizerConfig names them (Megatron-LM's
    get_megatron_optimizer_config copies every field the arguments share with it the same way)."""
    return {name: getattr(args, name) for name in OptimizerConfig.__dataclass_fields__
            if name.startswith("muon_") and hasattr(args, name)}


@dataclass(frozen=True)
class PrecisionSpec:
    """--fp16/--bf16 and the parameters' dtype; under --fp16 the loss scale: constant with
    ``loss_scale``, otherwise dynamic from ``initial_loss_scale``."""

    fp16: bool
    bf16: bool
    params_dtype: torch.dtype
    loss_scale: float | None
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: int
    hysteresis: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PrecisionSpec:
        return cls(args.fp16, args.bf16, args.params_dtype, args.loss_scale, args.initial_loss_scale,
                   args.min_loss_scale, args.loss_scale_window, args.hysteresis)


@dataclass(frozen=True)
class ExitSpec:
    """When to save and stop before --train-iters: --exit-interval, --exit-signal with
    --exit-signal-handler, --exit-duration-in-mins (0 or None: never)."""

    interval: int | None
    signal_handler: bool
    signal: int
    duration_in_mins: float | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ExitSpec:
        return cls(args.exit_interval, args.exit_signal_handler, args.exit_signal, args.exit_duration_in_mins)


@dataclass(frozen=True)
class TrainSpec:
    """Batches and iterations (``train_iters`` derived from --train-samples when given), evaluation
    (every ``eval_interval`` iterations and at the end, ``eval_iters`` batches), the NaN policy (with
    ``check_for_nan`` a NaN iteration skips its step, and ``max_consecutive_nan`` in a row stop the
    run), the weight-hash check (every ``weight_hash_interval`` iterations, None: never), and the optimizer,
    precision and exit sections."""

    global_batch_size: int
    micro_batch_size: int
    seq_length: int
    train_iters: int
    seed: int
    te_rng_tracker: bool  # megatron-core's CUDA RNG tracker is Transformer Engine's, where it is installed
    eval_iters: int
    eval_interval: int | None
    per_token_loss: bool
    check_for_nan: bool
    max_consecutive_nan: int
    weight_hash_interval: int | None
    optimizer: OptimizerSpec
    precision: PrecisionSpec
    exit: ExitSpec

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainSpec:
        return cls(args.global_batch_size, args.micro_batch_size, args.seq_length, args.train_iters, args.seed,
                   args.te_rng_tracker, args.eval_iters, args.eval_interval, args.calculate_per_token_loss,
                   args.check_for_nan_in_loss_and_grad, args.max_consecutive_nan_iterations,
                   args.check_weight_hash_across_dp_replicas_interval, OptimizerSpec.from_args(args),
                   PrecisionSpec.from_args(args), ExitSpec.from_args(args))
