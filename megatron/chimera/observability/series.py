"""Megatron-LM's optional log series, and the TensorBoard and W&B writers that receive them.

Each value has Megatron-LM's definition, counted over the logical model: a rank under Chimera holds two
copies of stages (the down and the up pipeline), identical replicas, and every stage counts once, as in
one process (the main weights' ``params_norm``/``zeros``, optim/main.py, weigh each copy by 1/copies, as the
gradient norm does). Tags, their ' vs samples' twins and the iteration-line fields follow megatron/training/training.py
(training_log, evaluate_and_print_results); docs/megatron.md lists them.
"""
from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist

from ..config.logging_spec import LogSpec, SeriesSpec

# Megatron-LM's evaluate_and_print_results caps the exponent at 20
PPL_CAP = 20.0


def set_logging_level(spec: SeriesSpec) -> None:
    """Megatron-LM's setup_logging: --logging-level, else $MEGATRON_LOGGING_LEVEL, sets the root logger's
    level; neither leaves it alone. Before the process group exists: the launcher's RANK says which rank says so."""
    level = spec.logging_level
    if level is None and os.getenv("MEGATRON_LOGGING_LEVEL") is not None:
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            logging.getLogger(__name__).info(f"Setting logging level to {level}")
        logging.getLogger().setLevel(level)


def validation_ppl(loss: float) -> float:
    return math.exp(min(PPL_CAP, loss))


def memory_scalars() -> dict[str, float]:
    """--log-memory-to-tensorboard: the CUDA caching allocator's counters, as Megatron-LM reads them.
    A CPU run has no such allocator: nothing."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"]}


class Writers:
    """TensorBoard (--tensorboard-dir) and W&B (--wandb-project), on the last rank, the one that logs, as
    Megatron-LM's global writers. W&B receives the same series (plain tags, at the iteration as step),
    whether or not TensorBoard is on. ``config``: what wandb.init records (Megatron-LM: vars(args))."""

    def __init__(self, log: LogSpec, config: dict | None = None):
        self.spec, self.tensorboard, self.wandb = log.series, None, None
        if dist.get_rank() != dist.get_world_size() - 1:
            return
        if log.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # here: the tensorboard package is optional

            self.tensorboard = SummaryWriter(log.tensorboard_dir, max_queue=self.spec.tensorboard_queue_size)
        if self.spec.wandb:
            self.wandb = _wandb_run(self.spec.wandb, config or {})

    def add(self, scalars: dict, iteration: int, samples: int | None = None) -> None:
        """Each scalar under its tag at ``iteration``; with ``samples`` (consumed samples) TensorBoard also
        gets '<tag> vs samples' at that x, where Megatron-LM writes the pair."""
        if self.tensorboard and scalars:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, iteration)
                if samples is not None:
                    self.tensorboard.add_scalar(f"{tag} vs samples", value, samples)
            self.tensorboard.flush()
        if self.wandb and scalars:
            self.wandb.log(scalars, iteration)

    def iteration(self, stats: dict, iteration: int, lr: float, loss_scale: float | None, batch_size: int,
                  world: int) -> None:
        """training_log's series, every --tensorboard-log-interval iterations: this iteration's values."""
        spec = self.spec
        if not (self.tensorboard or self.wandb) or iteration % spec.tensorboard_interval:
            return
        samples = iteration * batch_size
        if self.wandb:
            self.wandb.log({"samples vs steps": samples}, iteration)
        paired = {"learning-rate": lr, "batch-size": batch_size, "lm loss": stats["lm loss"]}
        if spec.loss_scale_to_tensorboard:
            paired["loss-scale"] = 1.0 if loss_scale is None else loss_scale  # Megatron-LM's: 1 without --fp16
        if spec.world_size_to_tensorboard:
            paired["world-size"] = world
        for tag, key in (("grad-norm", "grad norm"), ("num-zeros", "num zeros"), ("params-norm", "params norm")):
            if stats.get(key) is not None:
                paired[tag] = stats[key]
        self.add(paired, iteration, samples)
        self.add({**stats["moe"], **(memory_scalars() if spec.memory_to_tensorboard else {})}, iteration)

    def log_line(self, iteration: int, elapsed: float, timers, names, normalizer: float) -> None:
        """At the iteration line, with --log-timers-to-tensorboard: 'iteration-time' (seconds) and each
        timer's '<name>-time' (its maximum over ranks, seconds), through megatron-core's Timers.write, which
        gathers from every rank: collective. Timers are not reset here; the printed line resets them."""
        if not self.spec.timers_to_tensorboard:
            return
        self.add({"iteration-time": elapsed}, iteration)
        if names:
            timers.write(list(names), self.tensorboard, iteration, normalizer=normalizer, reset=False)
            timers.write(list(names), self.wandb, iteration, normalizer=normalizer, reset=False)

    def validation(self, loss: float, iteration: int, samples: int) -> None:
        """evaluate_and_print_results' series: the loss, and its perplexity with
        --log-validation-ppl-to-tensorboard."""
        scalars = {"lm loss validation": loss}
        if self.spec.validation_ppl_to_tensorboard:
            scalars["lm loss validation ppl"] = validation_ppl(loss)
        self.add(scalars, iteration, samples)

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def _wandb_run(spec, config: dict):
    """wandb.init as Megatron-LM's _set_wandb_writer calls it; the module is the writer."""
    import wandb  # here: an optional package (the `wandb` extra); config/run_rules.py checked it is installed

    kwargs = {"dir": spec.save_dir, "name": spec.exp_name, "project": spec.project, "config": config}
    if spec.entity:
        kwargs["entity"] = spec.entity
    os.makedirs(spec.save_dir, exist_ok=True)
    wandb.init(**kwargs)
    return wandb
