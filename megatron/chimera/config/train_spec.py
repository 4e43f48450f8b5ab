"""Training: the step's policies, the learning rate schedule, optimizer, precision and exit policy."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from megatron.core.optimizer.optimizer_config import OptimizerConfig

from .lr_schedule import lr_schedule


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """AdamW, or with --optimizer muon (``name``) Muon for the hidden weight matrices (``muon``: the --muon-*
    settings by megatron-core's OptimizerConfig field names), and the LR schedule. ``schedule``:
    megatron-core's OptimizerParamScheduler settings (lr_schedule.py), in samples: each iteration steps it by
    its global batch. ``decoupled_lr``/``decoupled_min_lr``:
    the input embedding's and output layer's own schedule (--decoupled-lr; the min defaults to --min-lr)."""

    lr: float
    min_lr: float
    lr_warmup_init: float
    schedule: dict
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
        return cls(lr=args.lr, min_lr=args.min_lr, lr_warmup_init=args.lr_warmup_init, schedule=lr_schedule(args),
                   override_scheduler=args.override_opt_param_scheduler,
                   use_checkpoint_scheduler=args.use_checkpoint_opt_param_scheduler, weight_decay=args.weight_decay,
                   betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, decoupled_lr=args.decoupled_lr,
                   decoupled_min_lr=decoupled_min, clip_grad=args.clip_grad,
                   distributed=args.use_distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
                   overlap_param_gather=args.overlap_param_gather,
                   apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm, name=args.optimizer,
                   muon=muon_settings(args),
                   layer_wise=getattr(args, "use_layer_wise_distributed_optimizer", False))


def muon_settings(args: argparse.Namespace) -> dict:
    """The --muon-* flags as megatron-core's OptimizerConfig names them (Megatron-LM's
    get_megatron_optimizer_config copies every field the arguments share with it the same way)."""
    return {name: getattr(args, name) for name in OptimizerConfig.__dataclass_fields__
            if name.startswith("muon_") and hasattr(args, name)}


@dataclass(frozen=True, kw_only=True)
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
        return cls(fp16=args.fp16, bf16=args.bf16, params_dtype=args.params_dtype, loss_scale=args.loss_scale,
                   initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
                   loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis)


@dataclass(frozen=True, kw_only=True)
class ExitSpec:
    """When to save and stop before --train-iters: --exit-interval, --exit-signal with
    --exit-signal-handler, --exit-duration-in-mins (0 or None: never)."""

    interval: int | None
    signal_handler: bool
    signal: int
    duration_in_mins: float | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ExitSpec:
        return cls(interval=args.exit_interval, signal_handler=args.exit_signal_handler, signal=args.exit_signal,
                   duration_in_mins=args.exit_duration_in_mins)


@dataclass(frozen=True, kw_only=True)
class RerunSpec:
    """Megatron-LM's rerun state machine (megatron-core's RerunStateMachine): ``mode`` (--rerun-mode:
    disabled, validate_results, report_stats), the errors it injects (--error-injection-rate, 0: none;
    --error-injection-type), the file its rejected results are appended to, and the validations beyond the
    one every iteration makes of its loss: a spiky loss (--check-for-spiky-loss), large gradients
    (--check-for-large-grads)."""

    mode: str
    injection_rate: int
    injection_type: str
    tracker_file: str | None
    spiky_loss: bool
    large_grads: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RerunSpec:
        return cls(mode=args.rerun_mode, injection_rate=args.error_injection_rate,
                   injection_type=args.error_injection_type, tracker_file=args.result_rejected_tracker_filename,
                   spiky_loss=args.check_for_spiky_loss, large_grads=args.check_for_large_grads)


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """The training step and its policies: the RNG tracker, the loss (summed per token with
    ``per_token_loss``), the NaN policy (with ``check_for_nan`` a NaN iteration skips its step, and
    ``max_consecutive_nan`` in a row stop the run), the weight-hash check (every ``weight_hash_interval``
    iterations, None: never), the rerun state machine, and the optimizer, precision and exit sections. The
    batches and the run's length (how many iterations, evaluated when) are the data section's (data_spec.py):
    one home."""

    te_rng_tracker: bool  # megatron-core's CUDA RNG tracker is Transformer Engine's, where it is installed
    per_token_loss: bool
    check_for_nan: bool
    max_consecutive_nan: int
    weight_hash_interval: int | None
    optimizer: OptimizerSpec
    precision: PrecisionSpec
    exit: ExitSpec
    rerun: RerunSpec

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainSpec:
        return cls(te_rng_tracker=args.te_rng_tracker, per_token_loss=args.calculate_per_token_loss,
                   check_for_nan=args.check_for_nan_in_loss_and_grad,
                   max_consecutive_nan=args.max_consecutive_nan_iterations,
                   weight_hash_interval=args.check_weight_hash_across_dp_replicas_interval,
                   optimizer=OptimizerSpec.from_args(args), precision=PrecisionSpec.from_args(args),
                   exit=ExitSpec.from_args(args), rerun=RerunSpec.from_args(args))
