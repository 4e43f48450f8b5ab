"""The training loop: one iteration is one flush of the pipeline schedule, then one optimizer step.

``pretrain`` builds the run plan once (config/run_plan.py) and hands it to the Trainer, which runs the
plan's forward_backward function (schedule_runner.py): our executor for our schedules, megatron-core's own
otherwise. The
loop does not know which schedule it runs. Tests and benchmarks act through ``hooks``
(observability/hooks.py), never inside the loop.
"""
from __future__ import annotations

import copy
import math
import os
import signal
import sys
import time
from datetime import datetime, timedelta

import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.training.training import num_floating_point_operations, print_datetime
from megatron.training.utils import print_rank_0, print_rank_last

from chimera_schedules import ConfigError
from chimera_schedules.ir.channels import EMBEDDING_GROUP, expert_group, stage_group
from chimera_schedules.runtime.faults import ComputeFault, PipelineFault, unattributed_fault
from chimera_schedules.runtime.messages import Transport
from chimera_schedules.runtime.p2p import EmulatedNCCL, TorchP2P

from .checkpoint.async_saves import async_saves
from .checkpoint.checkpointing import load_checkpoint, save_checkpoint
from .checkpoint.states import DataPosition, ModelChunks, OptimizerState, RNGState, State
from .config.data_spec import DataSpec
from .config.job import JobConfig, job_config
from .config.logging_spec import LogSpec
from .config.parallel_dims import ParallelDims
from .config.run_plan import make_run_plan, other_plans
from .config.train_spec import ExitSpec, OptimizerSpec, TrainSpec
from .data.datasets import GlobalBatch, MicrobatchSource, build_datasets, dataset_sizes, evaluation_index, iterators
from .data.global_batches import GlobalBatches
from .data.tokenizer import build_tokenizer
from .distributed.group_guard import guard_communicators
from .distributed.process_groups import init_distributed, made_here, release_groups, setup_parallel
from .distributed.schedule_agreement import ScheduleMismatch, agree_on_schedule
from .distributed.warmup import warm_up_communicators
from .distributed.weight_hashes import WeightHashMismatch, check_weight_hashes
from .model.chunk import build_chunk, uses_transformer_engine
from .model.moe import auxiliary_loss_fields, fresh_metrics, mtp_loss_fields, scale_auxiliary_losses, update_expert_bias
from .observability.hooks import Hooks
from .observability.housekeeping import Housekeeping
from .observability.series import Writers, set_logging_level, validation_ppl
from .observability.startup import (
    print_building,
    print_global_aux_loss,
    print_halves,
    print_layout,
    print_model_state,
    print_parameter_counts,
    print_ramp,
    print_schedule_proof,
    print_warm_up,
)
from .observability.timing import ITERATION, SETUP, make_timers, print_times
from .optim.main import build_main
from .optim.muon import steps_with_muon
from .optim.optimizer import build_optimizer, model_state_bytes
from .optim.precision import LossScaler, scaled_loss
from .rerun_machine import RerunExit, rerun_machine, validate, verdict
from .schedule_runner import runner


def _scheduler(spec: OptimizerSpec, optimizer):
    schedule = spec.schedule
    return OptimizerParamScheduler(
        optimizer, init_lr=spec.lr_warmup_init if schedule["lr_warmup_steps"] else spec.lr, **schedule,
        override_opt_param_scheduler=spec.override_scheduler,
        use_checkpoint_opt_param_scheduler=spec.use_checkpoint_scheduler)


def _transport(dims: ParallelDims, rt, backend: str, layout, dtype: torch.dtype) -> Transport:
    """Where our executor's messages go: this worker's peers, the process group of every channel, and
    the p2p implementation (gloo waits are bounded by --distributed-timeout-minutes; NCCL's are not,
    see TorchP2P). ``dtype``: the activations' (--params-dtype)."""
    timeout = timedelta(minutes=dims.timeout_minutes)
    p2p = EmulatedNCCL(timeout) if dims.emulate_nccl else TorchP2P(None if backend == "nccl" else timeout)
    groups = {**rt.p2p_groups, **{stage_group(s): g for s, g in rt.stage_groups.items()},
              **{expert_group(s): g for s, g in rt.expert_groups.items()}, EMBEDDING_GROUP: rt.embedding_group}
    return Transport(rt.worker, rt.worker_ranks, groups, rt.device, dtype, p2p, rt.comm_device, layout.output_rows())


class Trainer:
    """Everything one rank needs to train under a run plan: model chunks, optimizer, the iteration's
    forward_backward function, data. ``hooks`` (observability/hooks.py) see fixed points of each
    iteration and every compute action of our schedules. Each global batch size the run takes (a batch-size
    ramp's steps, --eval-global-batch-size) has a plan of its own (``plans``, the same chunks on every one);
    ``plan`` is --global-batch-size's, and each iteration and evaluation runs its batch's (``_use``)."""

    def __init__(self, job: JobConfig, plan, forward_step_func, hooks: Hooks = Hooks()):
        self.job, self.plan, self.hooks = job, plan, hooks
        dims, train, data = job.parallel, job.train, job.data
        backend, device = init_distributed(dims.backend, dims.timeout_minutes, dims.p2p_host_staging)
        self.rt = setup_parallel(dims, plan, backend, device)
        self.held = plan.held(self.rt.worker)  # the (pipeline, stage) copies this rank's chunks are
        fresh_metrics(job.model, plan.layout.chunk_slots())
        self.plans = {**other_plans(job.pipeline, dims), data.global_batch_size: plan}
        for each in self.plans.values():
            print_schedule_proof(each, agree_on_schedule(each))
        print_ramp(self.plans, data)
        torch.manual_seed(data.seed)
        model_parallel_cuda_manual_seed(data.seed, te_rng_tracker=train.te_rng_tracker)
        self.timers = make_timers(job.log)
        self.timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
        self._build_model_and_optimizer(forward_step_func, device)
        self.transport = (_transport(dims, self.rt, backend, plan.layout, train.precision.params_dtype)
                          if plan.schedule is not None else None)
        observer = hooks if hooks.observes_actions() else None
        self.runs = {size: (runner(each, self.models, self.transport, self.sync, observer, job.log.nvtx_ranges),
                            each.forward_orders(self.rt.worker)) for size, each in self.plans.items()}
        started = time.perf_counter()
        warmed = warm_up_communicators(self.rt, dims, list(self.plans.values()), self.transport)
        print_warm_up(warmed, time.perf_counter() - started, self.rt)
        self.micro_batch_size = int(data.micro_batch_size * plan.microbatch_scale)
        self._use(data.global_batch_size)
        self.rerun = rerun_machine(train.rerun, self.rt.device)
        self.timers("model-and-optimizer-setup").stop()
        print_datetime("after model, optimizer, and learning rate scheduler are built")
        self.timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
        exits = job.train.exit
        train, valid = build_datasets(data, build_tokenizer(data.tokenizer, job.megatron_args), *dataset_sizes(data))
        reading = (data, plan, self.rt.dp_rank, device.type == "cuda", exits.signal if exits.signal_handler else None)
        self.train_data, self.valid_data = MicrobatchSource(train, *reading), MicrobatchSource(valid, *reading)
        self.timers("train/valid/test-data-iterators-setup").stop()
        print_datetime("after dataloaders are built")
        # NCCL, or its emulation: from here a group or pair the warm-up missed fails at once, naming it. Last,
        # so that a constructor that raises leaves no guard installed in the process.
        self.guard = guard_communicators(warmed) if backend == "nccl" or dims.emulate_nccl else None

    def _build_model_and_optimizer(self, forward_step_func, device) -> None:
        """The chunks this rank holds, their main weights and gradient sync, the optimizer and the LR schedule."""
        rt, spec, model = self.rt, self.job.train.optimizer, self.job.model
        print_building(model, uses_transformer_engine(model.config.transformer_impl, device.type), device.type)
        print_layout(self.plan)
        print_halves(self.plan)
        print_global_aux_loss(model, rt)
        self.chunks = {key: build_chunk(model, self.plan, key[1], device) for key in self.held}
        print_parameter_counts(self.chunks, rt)
        self.models = [self.chunks[key] for key in self.held]
        self.main, self.sync = build_main(self.chunks, rt, spec)
        precision = self.job.train.precision
        self.scaler = LossScaler(precision) if precision.fp16 else None
        self.forward_step_func = scaled_loss(forward_step_func, self.scaler) if self.scaler else forward_step_func
        self.optimizer = build_optimizer(self.main, spec, device, self.models)
        self.scheduler = _scheduler(spec, self.optimizer)

    def close(self) -> None:
        """Free the process groups and communication threads, for a process that builds more trainers."""
        self.main.flush()
        self.train_data.close()
        self.valid_data.close()
        if self.transport is not None:
            self.transport.p2p.close()
            self.transport = None
        self.forward_backward = None
        if self.guard is not None:
            self.guard.uninstall()
        release_groups(self.rt)

    def _use(self, global_batch_size: int) -> None:
        """The plan, forward_backward function and data orders of a global batch of this size."""
        self.plan = self.plans[global_batch_size]
        self.forward_backward, self.orders = self.runs[global_batch_size]

    def _pipeline(self, source, batch: GlobalBatch, forward_only: bool) -> list:
        """One flush of the plan's schedule over the global batch; the last stages' loss reports."""
        self._use(batch.size)
        scale_auxiliary_losses(self.models[0].config, self.plan.microbatches, self.rt.device)
        return self.forward_backward(
            forward_step_func=self.forward_step_func,
            data_iterator=iterators(source, batch, self.orders, self.models, self.rt.device),
            model=self.models,
            num_microbatches=self.plan.microbatches,
            seq_length=self.job.data.seq_length,
            micro_batch_size=self.micro_batch_size,
            forward_only=forward_only,
        )

    def _merged_loss(self, reports) -> tuple[float, float]:
        """The global-batch loss from every rank that ran a last stage (both ends of every pipeline,
        every data-parallel replica): sum of token losses over number of tokens."""
        total = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for r in reports:
            total += r["lm loss"].double()
        self.rt.all_reduce(total)
        return (total[0] / total[1]).item(), total[1].item()

    def train_step(self, iteration: int, batch: GlobalBatch | None = None) -> dict:
        """One iteration over ``batch`` (by default batch ``iteration`` at --global-batch-size). A NaN/Inf loss
        or gradient norm (the same on every rank: both are all-reduced) skips the optimizer and scheduler
        step, unless --no-check-for-nan-in-loss-and-grad turns the check off (then, as in Megatron-LM, only
        fp16's loss scaler skips a step); the batch counts as consumed, as in Megatron."""
        batch = batch or GlobalBatch.at(iteration, self.job.data.global_batch_size)
        try:
            loss, norm = self._validated_gradients(iteration, batch)
        except NotImplementedError:  # a configuration the executor refuses: not a failed peer
            raise
        except Exception as e:  # our executor names its actions; the rest is told by where it was raised
            where = (f"a forward or backward of megatron-core's {self.plan.name} schedule"
                     if self.plan.schedule is None else "the loss or gradient norm after the pipeline")
            fault = e if isinstance(e, PipelineFault) else unattributed_fault(e, f"rank {self.rt.rank}", where,
                                                                              (self.rt, self.sync))
            if isinstance(fault, ComputeFault):  # a bug or out of memory here: its traceback, before the one line
                print(fault.trace(), end="", file=sys.stderr, flush=True)
            raise type(fault)(f"{fault.headline} (iteration {iteration + 1})", fault.context,  # joins the first line
                              fault.action) from fault.__cause__
        verdict(self.rerun)  # the machine may end the run here, before anything of the iteration is kept
        model = self.job.model
        moe = auxiliary_loss_fields(model, self.plan.layout.chunk_slots(), self.plan.microbatches, iteration + 1)
        moe.update(mtp_loss_fields(model, self.rt, self.plan.microbatches))
        if model.config.moe_router_enable_expert_bias:
            update_expert_bias(self.chunks, self.rt, model.config.moe_router_bias_update_rate)
        # as megatron-core's finalize_model_grads ends: the routers' counts of this iteration start afresh
        # (global_aux_loss's running token counts, expert bias's)
        reset_model_temporary_tensors(model.config, self.models)
        finite = math.isfinite(loss) and math.isfinite(norm)
        steps = finite or not (self.job.train.check_for_nan or self.scaler)
        zeros = self._step(norm, finite, steps, batch.size)
        series = self.job.log.series
        return {"lm loss": loss, "grad norm": norm if steps else None, "skipped": not steps,
                "global batch size": batch.size, "consumed samples": batch.first_sample + batch.size,
                "nan": self._nan_iteration(loss, finite, steps), "moe": moe, "num zeros": zeros,
                "params norm": self.main.params_norm() if series.params_norm else None}

    def _nan_iteration(self, loss: float, finite: bool, steps: bool) -> bool:
        """With the NaN check (Megatron-LM's default): a NaN/Inf loss, or gradient norm without a loss scaler
        (fp16 gradients that overflow lower the loss scale instead). Without it, what Megatron-LM's log counts
        as one: a skipped step whose loss is NaN/Inf."""
        if self.job.train.check_for_nan:
            return not math.isfinite(loss) or (not finite and self.scaler is None)
        return not steps and not math.isfinite(loss)

    def _validated_gradients(self, iteration: int, batch: GlobalBatch) -> tuple[float, float]:
        """The iteration's gradients, as often as Megatron-LM's rerun state machine (rerun_machine.py) runs
        them: once, or again in place from the same state and batch to judge a result it rejected (a re-run
        starts the routers' counts and the MoE and MTP trackers afresh). (loss, gradient norm) of the last run."""
        passes = 0
        while self.rerun.should_run_forward_backward(None):  # our iterators are rebuilt from the batch each run
            if passes:
                fresh_metrics(self.job.model, self.plan.layout.chunk_slots())
                reset_model_temporary_tensors(self.job.model.config, self.models)
            self.main.zero_grad(self.optimizer)
            for m in self.models:
                m.train()
            loss, norm = self._gradients(iteration, batch)
            validate(self.rerun, self.job.train.rerun, loss, norm)
            passes += 1
        barrier = self.job.log.barrier_with_l1_time
        self.timers("optimizer", log_level=1).start(barrier=barrier)
        self.timers("optimizer-clip-main-grad", log_level=1).start()
        return loss, norm

    def _gradients(self, iteration: int, batch: GlobalBatch) -> tuple[float, float]:
        """Forward and backward of the global batch, gradients reduced and unscaled; (loss, gradient norm)."""
        timers = self.timers
        timers("forward-backward", log_level=1).start(barrier=self.job.log.barrier_with_l1_time)
        self.hooks.before_iteration(self, iteration + 1)
        reports = self._pipeline(self.train_data, batch, forward_only=False)
        self.hooks.after_backward(self, iteration + 1)
        loss, tokens = self._merged_loss(reports)
        if self.job.train.per_token_loss:
            self._divide_gradients(tokens / self.rt.replicas)  # summed token losses: the global batch's mean
        timers("forward-backward").stop()
        if self.scaler:
            self.main.unscale(self.scaler.scale)
        return loss, self.main.grad_norm()

    def _divide_gradients(self, divisor: float) -> None:
        for p in self.main.all():
            if p.grad is not None:
                p.grad.div_(divisor)

    def _step(self, norm: float, finite: bool, steps: bool, samples: int) -> int | None:
        """Clip (a finite norm) and step, or skip the step; the LR schedule steps by the batch's ``samples``
        (Megatron-LM's count). With --log-num-zeros-in-grad, the zeros of the clipped gradient of a step taken
        (megatron-core's optimizer counts them there)."""
        timers, spec = self.timers, self.job.train.optimizer
        if finite and spec.clip_grad > 0:
            self.main.clip(spec.clip_grad, norm)
        timers("optimizer-clip-main-grad").stop()
        zeros = None
        if steps and self.job.log.series.num_zeros_in_grad:
            timers("optimizer-count-zeros", log_level=1).start(barrier=self.job.log.barrier_with_l1_time)
            zeros = self.main.zeros()
            timers("optimizer-count-zeros").stop()
        timers("optimizer-inner-step", log_level=1).start()
        if self.scaler:
            self.scaler.update(found_inf=not finite)
        if steps:
            self.optimizer.step()
            self.main.copy_to_model()
            self.scheduler.step(increment=samples)
        else:
            self.main.zero_grad(self.optimizer)
        timers("optimizer-inner-step").stop()
        timers("optimizer").stop()
        return zeros

    def check_weight_hashes(self, iteration: int) -> None:
        """--check-weight-hash-across-dp-replicas-interval (collective): every copy of every stage holds the same
        weights, or WeightHashMismatch on every rank; Megatron-LM's line when they do."""
        self.main.flush()  # --overlap-param-gather leaves the last gather to the next forward
        check_weight_hashes(self.chunks, self.rt, iteration)
        print_rank_0(f">>> Weight hashes match after {iteration} iterations...")

    def optimizer_steps(self) -> int:
        steps = [int(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return max(steps, default=0)

    def states(self) -> dict[str, State]:
        """What a checkpoint holds of this trainer, by name (checkpoint/states.py); the loop gives the data position."""
        states = {"model": ModelChunks.of(self.chunks, self.held, self.plan.layout, self.main),
                  "optimizer": OptimizerState(self.optimizer, self.main, self.models,
                                              steps_with_muon if self.job.train.optimizer.name == "muon" else None),
                  "lr_scheduler": self.scheduler, "rng": RNGState(self.rt.rank, self.rt.world)}
        if self.scaler:
            states["grad_scaler"] = self.scaler
        return states

    def evaluate(self, eval_round: int) -> float:
        """Forward only, through the same schedule: no backward, no gradient or optimizer state touched."""
        for m in self.models:
            m.eval()
        batches, size = self.job.data.eval_iters, self.job.data.eval_global_batch_size
        losses = [self._merged_loss(self._pipeline(self.valid_data, GlobalBatch.at(eval_round * batches + i, size),
                                                   forward_only=True))[0] for i in range(batches)]
        return sum(losses) / len(losses)


def pretrain(args, forward_step_func, hooks: Hooks = Hooks()) -> list[dict]:
    """Train until --train-iters, printing Megatron's log lines; resume from --load, save to --save.
    Returns the stats of the iterations this launch ran. A fault (dead peer, timeout, corrupted
    checkpoint, too many NaN iterations) ends this rank with one clear line and a non-zero exit.
    A caller that created the default process group keeps it: only the group made here is destroyed."""
    owns_process_group = not dist.is_initialized() or made_here()
    try:
        return _pretrain(job_config(args), forward_step_func, hooks, owns_process_group)
    except RerunExit as e:  # the machine has logged its verdict on every rank
        print_rank_last(f" exiting with code {e.code}: {e}")
        sys.stdout.flush()
        os._exit(e.code)
    except (PipelineFault, ConfigError, TrainingStopped, WeightHashMismatch) as e:
        if not isinstance(e, (ScheduleMismatch, WeightHashMismatch)) or dist.get_rank() == 0:  # raised on every rank
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # peers may be gone: no collective clean-up that could hang


class TrainingStopped(RuntimeError):
    pass


class _ExitPolicy:
    """When to save and stop before --train-iters, as Megatron-LM does: on --exit-signal (SIGTERM) with
    --exit-signal-handler (Slurm's preemption warning), every --exit-interval iterations, or once
    --exit-duration-in-mins have passed since the start. Ranks agree at each iteration boundary (one
    all-reduce), so they all save the same checkpoint and stop together."""

    def __init__(self, spec: ExitSpec):
        self.spec, self.received, self.start = spec, False, time.time()
        if spec.signal_handler:
            signal.signal(spec.signal, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def reason(self, done: int, rt) -> str | None:
        spec = self.spec
        if spec.interval and done % spec.interval == 0:
            return f"--exit-interval {spec.interval}"
        if not (spec.signal_handler or spec.duration_in_mins):
            return None
        minutes = (time.time() - self.start) / 60
        local = [int(self.received), int(bool(spec.duration_in_mins) and minutes > spec.duration_in_mins)]
        flags = torch.tensor(local, dtype=torch.int32, device=rt.device)
        rt.all_reduce(flags)
        if flags[0]:
            return signal.Signals(spec.signal).name
        return f"--exit-duration-in-mins {spec.duration_in_mins:g}" if flags[1] else None


def _pretrain(job: JobConfig, forward_step_func, hooks: Hooks, owns_process_group: bool) -> list[dict]:
    data, log = job.data, job.log
    set_logging_level(log.series)
    exit_policy = _ExitPolicy(job.train.exit)
    trainer = Trainer(job, make_run_plan(job.pipeline, job.parallel), forward_step_func, hooks)
    position = _resume(trainer)
    first = position.iteration
    print_model_state(model_state_bytes(trainer.models, trainer.main, trainer.optimizer), log.memory_per_rank)
    board = Writers(log, vars(job.megatron_args))
    if first >= data.train_iters:  # a requeued or chained job after the run's end: write nothing
        print_rank_last(f" training already complete at iteration {first} (--train-iters {data.train_iters}):"
                        " nothing to train")
        if data.eval_iters:  # as Megatron-LM, evaluate what was loaded
            _evaluate_and_print(trainer, board, first, position.consumed_samples)
        board.close()
        _shut_down(trainer, owns_process_group)
        return []
    print_rank_last("done with setup ...")
    print_times(trainer.timers, SETUP)
    print_rank_last("training ...")
    # a copy: Megatron-LM's function writes derived values (query groups) into the namespace it is given
    flops = num_floating_point_operations(copy.copy(job.megatron_args), 1) if log.throughput else None  # per sample
    progress = _Progress(job.train, data, log, first, board, trainer.timers, flops=flops, world=job.parallel.world,
                         loaded=bool(job.checkpoint.load), save_dir=job.checkpoint.save)
    housekeeping = Housekeeping(log, trainer.rt.rank)
    saves = async_saves() if job.checkpoint.async_save else None
    try:
        history = _train(trainer, GlobalBatches(data, position.consumed_samples), first, progress, housekeeping,
                         board, exit_policy, saves)
    finally:
        housekeeping.stop()
    _finalise(saves)
    board.close()
    _shut_down(trainer, owns_process_group)
    return history


def _finalise(saves) -> None:
    """Collective: the asynchronous save in flight written and published (--async-save), at the end of the
    run. Not on a fault a peer caused, which no longer answers: that save stays unpublished, the previous
    checkpoint the latest."""
    if saves is not None:
        saves.close()


def _shut_down(trainer, owns_process_group: bool) -> None:
    """Destroy every process group before the interpreter finalizes: a gloo group left alive keeps
    worker threads whose clean-up during finalization can abort the process (SIGABRT, 'terminate called
    without an active exception') after a run that succeeded. The barrier keeps a rank from tearing
    down while a peer still talks to it. The default group is the caller's to destroy if it made it."""
    dist.barrier()
    trainer.close()
    if owns_process_group:
        dist.destroy_process_group()


def _train(trainer, batches: GlobalBatches, first: int, progress, housekeeping, board, exit_policy,
           saves) -> list[dict]:
    """The iterations from ``first``, each over the next of ``batches``; ``saves``: the queue of asynchronous
    saves (--async-save), whose
    finished ones are published at each iteration's end, as Megatron-LM does; after a NaN iteration (which
    may stop the run, naming the last checkpoint) or before an early exit, the one in flight too."""
    data = trainer.job.data
    hashes = trainer.job.train.weight_hash_interval
    if hashes:  # as Megatron-LM, once before training too
        trainer.check_weight_hashes(first)
    for iteration in range(first, data.train_iters):
        housekeeping.before_iteration(iteration)
        lr = trainer.optimizer.param_groups[0]["lr"]
        batch = batches.next()
        try:
            stats = trainer.train_step(iteration, batch)
        except RerunExit as e:  # the iteration is not done: a checkpoint the machine asks for is the last one's
            if e.checkpoint:
                position = DataPosition(data.global_batch_size, iteration, batch.first_sample)
                _maybe_save(trainer, progress, {"nan": False}, position, "the rerun state machine", saves)
            _finalise(saves)
            raise
        done = iteration + 1
        if saves is not None:
            saves.maybe_finalize_async_calls(blocking=stats["nan"])
        housekeeping.after_iteration(done)
        progress.record(stats, done, lr, trainer.scaler and trainer.scaler.scale)
        if hashes and done % hashes == 0:
            trainer.check_weight_hashes(done)
        if data.eval_iters and (data.eval_interval and done % data.eval_interval == 0 or done == data.train_iters):
            housekeeping.around_evaluation()
            _evaluate_and_print(trainer, board, done, batches.consumed)
        stop = exit_policy.reason(done, trainer.rt) if done < data.train_iters else None
        _maybe_save(trainer, progress, stats, DataPosition(data.global_batch_size, done, batches.consumed), stop,
                    saves)
        if stop:
            if saves is not None:
                saves.maybe_finalize_async_calls(blocking=True)
            saved = " after saving it" if trainer.job.checkpoint.save else ""
            print_rank_last(f" exiting on {stop} at iteration {done}" + saved)
            return progress.history
        progress.restart_clock(done)
    return progress.history


def _resume(trainer) -> DataPosition:
    """Where to start from: the loaded checkpoint's iteration and consumed samples, or the start."""
    spec = trainer.job.checkpoint
    position = DataPosition(trainer.job.data.global_batch_size)
    if spec.fresh_start:
        print_rank_last(f" no checkpoint in {spec.fresh_start} yet (--load = --save): starting from scratch")
    if not spec.load:
        return position
    load_checkpoint(trainer.states(), position, spec, trainer.rt)
    print_rank_last(f" loaded checkpoint from {spec.load} at iteration {position.iteration}")
    return position


def _maybe_save(trainer, progress, stats: dict, position: DataPosition, stop: str | None, saves) -> None:
    """Megatron's save policy: every --save-interval, at the end, and before an early exit; with the NaN
    check, never the state of a NaN iteration. ``position``: after the iteration just done. Megatron-LM's
    'save-checkpoint' timer: how long the save stopped training (with --async-save, until its files were
    handed to the writer)."""
    data, spec, done = trainer.job.data, trainer.job.checkpoint, position.iteration
    kept = not (stats["nan"] and trainer.job.train.check_for_nan)
    if spec.save and kept and (done % spec.save_interval == 0 or done == data.train_iters or stop):

        def published(folder: str) -> None:
            progress.last_saved = done
            print_rank_last(f" saved checkpoint at iteration {done} to {folder}")

        trainer.timers("save-checkpoint", log_level=0).start(barrier=False)
        save_checkpoint(trainer.states(), position, spec, trainer.rt, trainer.job.megatron_args,
                        lambda: trainer.hooks.during_save(trainer, done), published, saves)
        trainer.timers("save-checkpoint").stop(barrier=False)
        if saves is not None:
            print_rank_last(f" scheduled an async checkpoint save at iteration {done} to {spec.save}")
        print_times(trainer.timers, ("save-checkpoint",))


class _Progress:
    """What the log line reports: losses and NaN counts since the last line, and the time of the
    iterations themselves (not of logging, evaluation or saving). With the NaN check, stops the run after too many NaN
    iterations in a row."""

    def __init__(self, train: TrainSpec, data: DataSpec, log: LogSpec, first: int, board: Writers, timers, *,
                 flops: float | None = None, world: int = 1, loaded: bool = False, save_dir: str | None = None):
        """``flops``: Megatron-LM's model FLOPs of one sample, with --log-throughput; ``world``: the
        ranks they are shared by; ``loaded``: whether the run resumed (the loaded iteration is its last
        saved one); ``save_dir``: --save, named when the NaN policy stops the run."""
        self.train, self.data, self.log, self.board, self.timers = train, data, log, board, timers
        self.flops, self.world, self.save_dir = flops, world, save_dir
        self.history, self.nan_run = [], 0
        self.last_saved = first if loaded else None
        self.first, self.logged, self.start = first, first, time.time()

    def record(self, stats: dict, done: int, lr: float, loss_scale: float | None) -> None:
        self.history.append(stats)
        self.nan_run = self.nan_run + 1 if stats["nan"] else 0
        self.board.iteration(stats, done, lr, loss_scale, stats["global batch size"], self.world)
        if done % self.log.interval == 0 or done == self.data.train_iters or self.nan_run:
            iterations = done - self.logged
            elapsed = self._log(done, lr, loss_scale)
            timed = ITERATION if self.log.timing_level >= 1 else ()
            self.board.log_line(done, elapsed, self.timers, timed, normalizer=iterations)
            if timed:
                print_times(self.timers, ITERATION, normalizer=iterations)
        if self.train.check_for_nan and self.nan_run >= self.train.max_consecutive_nan:
            raise TrainingStopped(self._nan_message(done))

    def restart_clock(self, done: int) -> None:
        if done == self.logged:
            self.start = time.time()

    def _log(self, done: int, lr: float, loss_scale: float | None) -> float:
        """Megatron-LM's iteration line: the loss averaged over the iterations since the last line that
        stepped (none stepped: no loss field), 'loss scale' with --fp16, no 'grad norm' (nor 'num zeros')
        after a skipped step, 'params norm' with --log-params-norm, and the skipped and NaN iterations since
        the last line. Returns the seconds per iteration."""
        data = self.data
        recent = self.history[self.logged - self.first:]
        elapsed = (time.time() - self.start) / len(recent)
        stepped = [s["lm loss"] for s in recent if not s["skipped"]]
        loss = sum(stepped) / len(stepped) if stepped else None
        moe = _mean_fields([s["moe"] for s in recent if not s["skipped"]])
        samples = sum(s["global batch size"] for s in recent) / len(recent)  # per iteration
        throughput = samples * data.seq_length / elapsed
        norm, zeros, params = (recent[-1][key] for key in ("grad norm", "num zeros", "params norm"))
        skipped, nans = sum(s["skipped"] for s in recent), sum(s["nan"] for s in recent)
        print_rank_last(
            f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {done:8d}/{data.train_iters:8d} |"
            f" consumed samples: {recent[-1]['consumed samples']:12d} |"
            f" elapsed time per iteration (ms): {elapsed * 1000:.1f} |{self._tflops(elapsed, samples)}"
            f" throughput (tokens/s): {throughput:.1f} |"
            f" learning rate: {lr:.6E} | global batch size: {recent[-1]['global batch size']:5d} |"
            + ("" if loss is None else f" lm loss: {loss:.6E} |")
            + "".join(f" {name}: {value:.6E} |" for name, value in moe.items() if value > 0)
            + ("" if loss_scale is None else f" loss scale: {loss_scale:.1f} |")
            + ("" if norm is None else f" grad norm: {norm:.3f} |")
            + ("" if zeros is None else f" num zeros: {float(zeros)} |")  # Megatron-LM's: a float
            + ("" if params is None else f" params norm: {params:.3f} |") +
            f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nans:3d} |")
        self.board.add({"throughput": throughput}, done)
        self.logged = done
        return elapsed

    def _tflops(self, seconds: float, samples: float) -> str:
        """Megatron-LM's --log-throughput field: model TFLOP/s per device (here per rank), of ``samples`` per
        iteration."""
        if self.flops is None:
            return ""
        per_rank = self.flops * samples / seconds / self.world
        return f" throughput per GPU (TFLOP/s/GPU): {per_rank / 1e12:.1f} |"

    def _nan_message(self, done: int) -> str:
        limit, run = self.train.max_consecutive_nan, self.nan_run
        kept = (f"the last good checkpoint is iteration {self.last_saved} in {self.save_dir}" if self.last_saved
                else "no checkpoint saved")
        return (f"{run} iterations in a row ({done - run + 1}-{done}) had a NaN or Inf loss or gradient norm "
                f"(--max-consecutive-nan-iterations {limit}); stopping; {kept}")


def _mean_fields(fields: list[dict]) -> dict[str, float]:
    """Each field's mean over the iterations that report it (Megatron-LM averages its loss fields over
    the iterations since the last line)."""
    names = dict.fromkeys(name for f in fields for name in f)
    return {name: sum(f[name] for f in fields if name in f) / sum(name in f for f in fields) for name in names}


def _evaluate_and_print(trainer, board: Writers, iteration: int, consumed: int) -> None:
    loss = trainer.evaluate(evaluation_index(trainer.job.data, iteration))
    print_rank_last(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
                    f" lm loss PPL: {validation_ppl(loss):.6E} |")
    board.validation(loss, iteration, consumed)
