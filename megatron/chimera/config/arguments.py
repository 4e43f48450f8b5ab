"""Command-line arguments with Megatron-LM's flag names, plus the Chimera schedule flags.

``parse_args`` also validates everything that can be known before a process group exists, so an
impossible layout fails at once with one line naming the flag and the rule (exit code 2)."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from chimera_schedules import ScheduleConfigError, ScheduleSpec, build_spec
from chimera_schedules.build import check_options
from chimera_schedules.errors import require
from chimera_schedules.spec import OPTION, SCHEDULES, SHARED, add_arguments, flags

from ..model.flags import add_architecture_flags, add_compatibility_flags
from .plan import run_plan
from ..data.tokenizer import add_arguments as add_tokenizer_arguments
from ..data.tokenizer import build_tokenizer, padded_vocab_size
from ..data.tokenizer import check_arguments as check_tokenizer_arguments

MEGATRON_SCHEDULES = ("megatron-1f1b", "megatron-interleaved")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        _fail(f"{self.prog}: error: {message}")


def _fail(line: str):
    """Exit 2 on every rank, printing the line once (rank 0), as Megatron-LM prints."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="GPT pretraining with Chimera and baseline pipeline schedules.",
                allow_abbrev=False)  # Megatron-LM's rule: --exit-signal must not parse as --exit-signal-handler
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, required=True)
    m.add_argument("--hidden-size", type=int, required=True)
    m.add_argument("--num-attention-heads", type=int, required=True)
    m.add_argument("--seq-length", type=int, required=True)
    m.add_argument("--max-position-embeddings", type=int, required=True)
    m.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                   default="learned_absolute")
    m.add_argument("--use-rotary-position-embeddings", action="store_true", help="= --position-embedding-type rope")
    m.add_argument("--no-position-embedding", action="store_true",
                   help="no learned position table (with RoPE: RoPE only; else --position-embedding-type none)")
    m.add_argument("--rotary-base", type=int, default=10000)
    m.add_argument("--rotary-percent", type=float, default=1.0)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    m.add_argument("--swiglu", action="store_true", help="gated linear unit with SiLU (Llama's MLP)")
    m.add_argument("--group-query-attention", action="store_true", help="use --num-query-groups")
    m.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default="transformer_engine",
                   help="layer spec on a GPU with Transformer Engine installed; the CPU always uses local")
    add_architecture_flags(m)
    m.add_argument("--recompute-granularity", choices=("full", "selective"))
    m.add_argument("--recompute-activations", action="store_true", help="= --recompute-granularity selective")
    m.add_argument("--recompute-method", choices=("uniform", "block"))
    m.add_argument("--recompute-num-layers", type=int, default=1)
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, required=True)
    t.add_argument("--global-batch-size", type=int, required=True)
    t.add_argument("--train-iters", type=int, help="iterations to train (or --train-samples)")
    t.add_argument("--train-samples", type=int, help="samples to train; the LR schedule then counts samples")
    t.add_argument("--lr", type=float, required=True)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"),
                   default="linear")
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    t.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples")
    t.add_argument("--lr-decay-samples", type=int, help="with --train-samples (default: --train-samples)")
    t.add_argument("--lr-warmup-fraction", type=float, help="warmup as a fraction of the decay steps")
    t.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, use this run's LR schedule instead of the checkpoint's")
    t.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, keep the checkpoint's LR schedule whatever this run's flags say")
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--max-consecutive-nan-iterations", type=int, default=5,
                   help="stop after this many iterations in a row with a NaN/Inf loss or gradient norm")
    t.add_argument("--exit-interval", type=int, help="save and exit after every this many iterations")
    t.add_argument("--exit-duration-in-mins", type=float, help="save and exit once this long has passed")
    t.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, save a checkpoint at the next iteration boundary and exit cleanly")
    t.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations, fp32 main weights and gradients (no loss scale)")
    _add_fp16_flags(t)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--log-interval", type=int, default=100)
    t.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0,
                   help="0: setup times; 1: also forward-backward and optimizer per log interval (2: as 1 here)")
    t.add_argument("--timing-log-option", choices=("max", "minmax", "all"), default="minmax")
    t.add_argument("--no-barrier-with-level-1-timing", dest="barrier_with_L1_time", action="store_false",
                   help="level-1 timers start without a barrier (less exact, no synchronisation)")
    t.add_argument("--log-throughput", action="store_true",
                   help="add Megatron-LM's 'throughput per GPU (TFLOP/s/GPU)' (per rank) to the iteration line")
    t.add_argument("--eval-interval", type=int, default=1000)
    t.add_argument("--eval-iters", type=int, default=100, help="validation iterations per evaluation (0: none)")
    c = p.add_argument_group("checkpoints and logging")
    c.add_argument("--save", help="checkpoint directory to write")
    c.add_argument("--load", help="checkpoint directory to resume from")
    c.add_argument("--save-interval", type=int, default=1000)
    c.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist",
                   help="the format --save writes: torch_dist (megatron-core's dist_checkpointing). Loading "
                        "detects the format and also reads Megatron-LM's legacy per-rank torch files")
    c.add_argument("--finetune", action="store_true",
                   help="load the weights only: no optimizer, scheduler or RNG state, iteration 0")
    c.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer and LR scheduler state")
    c.add_argument("--no-load-rng", action="store_true", help="do not load the RNG states")
    c.add_argument("--tensorboard-dir")
    d = p.add_argument_group("data")
    d.add_argument("--mock-data", action="store_true", help="megatron-core's MockGPTDataset")
    d.add_argument("--data-path", nargs="+", help="PREFIX, or a blend: WEIGHT PREFIX WEIGHT PREFIX ...")
    d.add_argument("--split", default="969,30,1", help="train,valid,test proportions of each dataset")
    d.add_argument("--data-cache-path", help="where megatron-core caches the dataset indices")
    add_tokenizer_arguments(d)
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    par.add_argument("--virtual-pipeline-model-parallel-size", type=int,
                     help="model chunks per pipeline rank (Megatron-LM's other spelling of the one above)")
    par.add_argument("--context-parallel-size", type=int, default=1,
                     help="1 only: context parallelism is not supported yet")
    par.add_argument("--sequence-parallel", action="store_true",
                     help="split the sequence over tensor-parallel ranks outside the tensor-parallel regions "
                          "(off with TP=1, as in Megatron-LM)")
    par.add_argument("--distributed-backend", choices=("gloo", "nccl"), help="default: nccl on GPU, gloo on CPU")
    par.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    par.add_argument("--emulate-nccl", action="store_true",
                     help="CPU only: run p2p over gloo under NCCL's rules (in-order streams per pair and group, "
                          "sends that wait for their receive), to try a layout before a GPU job")
    par.add_argument("--p2p-host-staging", action="store_true",
                     help="GPU compute, gloo communication through host memory: several ranks on one GPU")
    par.add_argument("--pipeline-schedule", choices=SCHEDULES + MEGATRON_SCHEDULES,
                     help="default: megatron-core's own (1f1b, or interleaved with virtual stages)")
    add_arguments(par, "trainer")
    _add_runtime_flags(p)
    add_compatibility_flags(p)
    return p


def _add_fp16_flags(t) -> None:
    """Megatron-LM's fp16 mixed precision and its loss-scale options, with its defaults."""
    t.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and activations, fp32 main weights and gradients, loss scaling")
    t.add_argument("--loss-scale", type=float, help="a constant loss scale (default: dynamic)")
    t.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, help="the dynamic loss scale's start")
    t.add_argument("--min-loss-scale", type=float, default=1.0, help="the dynamic loss scale's floor")
    t.add_argument("--loss-scale-window", type=int, default=1000,
                   help="clean iterations before the dynamic loss scale doubles")
    t.add_argument("--hysteresis", type=int, default=2, help="overflowing iterations before it halves")
    t.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="always so here: gradients accumulate and reduce in fp32 under --fp16 and --bf16")


def _validate_precision(args) -> None:
    require(not (args.fp16 and args.bf16), "--fp16", True, "give one of --fp16 and --bf16")
    require(not args.overlap_param_gather or args.use_distributed_optimizer, "--overlap-param-gather", True,
            "needs --use-distributed-optimizer (Megatron-LM's rule)")
    for flag, value in (("--initial-loss-scale", args.initial_loss_scale), ("--min-loss-scale", args.min_loss_scale),
                        ("--loss-scale-window", args.loss_scale_window), ("--hysteresis", args.hysteresis),
                        ("--loss-scale", args.loss_scale or 1)):
        require(value > 0, flag, value, "must be positive")
    require(args.min_loss_scale <= args.initial_loss_scale, "--min-loss-scale", args.min_loss_scale,
            f"must not exceed --initial-loss-scale ({args.initial_loss_scale:g})")
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32


def _add_runtime_flags(p) -> None:
    """Megatron-LM's optimizer, memory, data-reading and profiling options its recipes pass."""
    r = p.add_argument_group("Megatron-LM run-time options")
    r.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state and fp32 main weights of each stage over its replica group "
                        "(its copies x data-parallel replicas)")
    r.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: finish each chunk's weight all-gather at its next "
                        "forward, overlapping the next iteration's first forwards")
    r.add_argument("--log-memory-per-rank", action="store_true",
                   help="print every rank's model-state bytes after setup, not only the largest")
    r.add_argument("--decoupled-lr", type=float, help="LR of the input embedding and output layer")
    r.add_argument("--decoupled-min-lr", type=float, help="their minimum LR (default: --min-lr)")
    r.add_argument("--rampup-batch-size", nargs=3, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="not supported yet: every batch size needs its own pipeline schedule")
    r.add_argument("--manual-gc", action="store_true", help="Python's GC only at fixed points, in step on all ranks")
    r.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: collect every N iterations")
    r.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: no collection around evaluation")
    r.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="release the CUDA cache after each iteration (1) and evaluation (2); nothing on the CPU")
    r.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read .bin files without memory-mapping them")
    r.add_argument("--profile", action="store_true", help="profile iterations --profile-step-start..end")
    r.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch.profiler traces into --tensorboard-dir (otherwise an nsys range, CUDA)")
    r.add_argument("--profile-step-start", type=int, default=10)
    r.add_argument("--profile-step-end", type=int, default=12)
    r.add_argument("--profile-ranks", nargs="+", type=int, default=[0])


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate. Exits with code 2 and one line on an impossible configuration."""
    args = _parser().parse_args(argv)
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        _validate(args)
    except ScheduleConfigError as e:
        _fail(f"pretrain_gpt.py: error: {e.message(flags('trainer'))}")
    return args


def _validate(args) -> None:
    _training_length(args)
    _megatron_spellings(args)
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                 "micro_batch_size", "global_batch_size", "train_iters", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size"):
        require(getattr(args, flag) > 0, "--" + flag.replace("_", "-"), getattr(args, flag), "must be positive")
    for flag, value in (("--log-interval", args.log_interval), ("--eval-interval", args.eval_interval),
                        ("--save-interval", args.save_interval), ("--recompute-num-layers", args.recompute_num_layers),
                        ("--distributed-timeout-minutes", args.distributed_timeout_minutes),
                        ("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by),
                        ("--max-consecutive-nan-iterations", args.max_consecutive_nan_iterations),
                        ("--exit-interval", args.exit_interval or 1),
                        ("--exit-duration-in-mins", args.exit_duration_in_mins or 1)):
        require(value > 0, flag, value, "must be positive")
    for flag, value in (("--eval-iters", args.eval_iters), ("--lr", args.lr), ("--min-lr", args.min_lr),
                        ("--lr-warmup-iters", args.lr_warmup_iters), ("--weight-decay", args.weight_decay),
                        ("--clip-grad", args.clip_grad), ("--hidden-dropout", args.hidden_dropout),
                        ("--attention-dropout", args.attention_dropout)):
        require(value >= 0, flag, value, "must not be negative")
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir)):
        if path:
            require(_writable(path), flag, path, "must be a writable directory, or creatable in a writable one")
    require(args.ckpt_format == "torch_dist" or not args.save, "--ckpt-format", args.ckpt_format,
            "is read, not written: --save writes torch_dist (loading detects the format)")
    _validate_data(args)
    require(args.seq_length <= args.max_position_embeddings, "--seq-length", args.seq_length,
            f"must not exceed --max-position-embeddings ({args.max_position_embeddings})")
    require(args.hidden_size % args.num_attention_heads == 0, "--num-attention-heads", args.num_attention_heads,
            f"must divide --hidden-size ({args.hidden_size})")
    _validate_precision(args)
    require(not args.emulate_nccl or args.distributed_backend != "nccl" and not args.p2p_host_staging
            and not torch.cuda.is_available(), "--emulate-nccl", True,
            "is for the CPU (gloo): on a GPU, run NCCL itself")
    require(not args.p2p_host_staging or torch.cuda.is_available(), "--p2p-host-staging", True,
            "needs a CUDA device (it stages GPU tensors through host memory)")
    if args.recompute_granularity == "full":
        require(args.recompute_method is not None, "--recompute-method", None,
                "--recompute-granularity full needs uniform or block")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    require(args.world_size % (tp * pp) == 0, "--pipeline-model-parallel-size", pp,
            f"TP x PP = {tp * pp} must divide the world size {args.world_size}")
    args.data_parallel_size = args.world_size // (tp * pp)
    per_step = args.micro_batch_size * args.data_parallel_size
    require(args.global_batch_size % per_step == 0, "--global-batch-size", args.global_batch_size,
            f"must be a multiple of micro-batch size x data-parallel size = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    _validate_architecture(args)
    args.padded_vocab_size = padded_vocab_size(build_tokenizer(args).vocab_size, args.make_vocab_size_divisible_by, tp)

    if args.pipeline_schedule is None:
        args.pipeline_schedule = "megatron-interleaved" if args.num_layers_per_virtual_pipeline_stage else "megatron-1f1b"
    check_options(args.pipeline_schedule, _given(args))
    chunks = 1
    if args.pipeline_schedule in ("interleaved", "megatron-interleaved"):
        v = args.num_layers_per_virtual_pipeline_stage
        require(v is not None and v > 0, "--num-layers-per-virtual-pipeline-stage", v,
                f"--pipeline-schedule {args.pipeline_schedule} needs it")
        require(args.num_layers % (pp * v) == 0, "--num-layers-per-virtual-pipeline-stage", v,
                f"PP x it must divide --num-layers ({args.num_layers})")
        chunks = args.num_layers // (pp * v)
        if args.pipeline_schedule == "megatron-interleaved":
            require(pp > 2, "--pipeline-model-parallel-size", pp, "megatron-core's interleaved schedule needs more "
                    "than 2 stages (at 2 its batched p2p pairs activations and gradients on one channel); "
                    "--pipeline-schedule interleaved runs at any depth")
    else:
        require(args.num_layers_per_virtual_pipeline_stage is None, "--num-layers-per-virtual-pipeline-stage",
                args.num_layers_per_virtual_pipeline_stage, "applies to the interleaved schedules only")
    if args.pipeline_schedule == "dualpipev":
        chunks = 2  # one pipeline folded into a V: each rank holds a stage on the way out and one back
    require(args.num_layers % (pp * chunks) == 0, "--num-layers", args.num_layers,
            f"must be divisible by the {pp * chunks} pipeline stages")
    args.model_stages = pp * chunks
    if args.chimera_concat == "halving":
        require(args.micro_batch_size % 2 == 0, "--micro-batch-size", args.micro_batch_size,
                "must be even for --chimera-concat halving (it runs half-size micro-batches)")
    args.schedule = _schedule(args, chunks) if pp > 1 and args.pipeline_schedule in SCHEDULES else None
    args.plan = run_plan(args)
    args.fresh_start = None
    if args.load and _first_launch(args):
        args.fresh_start, args.load = args.load, None
    if args.load:
        _validate_checkpoint(args)


def _megatron_spellings(args) -> None:
    """Megatron-LM's alternative spellings, mapped as Megatron-LM maps them, and the parallelism it
    has and we do not yet, refused by name."""
    if args.recompute_activations:
        require(args.recompute_granularity in (None, "selective"), "--recompute-activations", True,
                f"means --recompute-granularity selective, not {args.recompute_granularity}")
        args.recompute_granularity = "selective"
    v, pp = args.virtual_pipeline_model_parallel_size, args.pipeline_model_parallel_size
    if v is not None and v > 1:
        require(args.num_layers_per_virtual_pipeline_stage is None and args.num_layers % (pp * v) == 0,
                "--virtual-pipeline-model-parallel-size", v, f"PP x it must divide --num-layers ({args.num_layers}), "
                "without --num-layers-per-virtual-pipeline-stage")
        args.num_layers_per_virtual_pipeline_stage = args.num_layers // (pp * v)
    rampup = args.rampup_batch_size and " ".join(args.rampup_batch_size)
    require(args.rampup_batch_size is None or args.train_samples is not None, "--rampup-batch-size", rampup,
            "expected no batch-size rampup for iteration-based training (Megatron-LM's rule: use --train-samples)")
    require(args.rampup_batch_size is None, "--rampup-batch-size", rampup,
            "is not supported yet: every batch size needs its own pipeline schedule")
    require(args.context_parallel_size == 1, "--context-parallel-size", args.context_parallel_size,
            "context parallelism is not supported yet (1 only)")
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # Megatron-LM's rule: nothing to split
    require(not args.sequence_parallel or args.seq_length % args.tensor_model_parallel_size == 0,
            "--sequence-parallel", True, f"needs --seq-length divisible by TP ({args.tensor_model_parallel_size})")


def _validate_architecture(args) -> None:
    """Megatron-LM's derived settings: the position embedding from its shorthand flags, the FFN width
    (4h, or 2/3 of it rounded down to 64 with SwiGLU), query groups only with --group-query-attention."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.no_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"  # as in Megatron-LM: drops the learned table, keeps RoPE
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if not args.group_query_attention:
        args.num_query_groups = None
    else:
        groups, tp = args.num_query_groups, args.tensor_model_parallel_size
        require(groups is not None and groups > 0 and args.num_attention_heads % groups == 0, "--num-query-groups",
                groups, f"must divide --num-attention-heads ({args.num_attention_heads})")
        require(groups % tp == 0, "--num-query-groups", groups,
                f"must be a multiple of --tensor-model-parallel-size ({tp})")


def _require_documents(args, prefix: str) -> None:
    """Every part of --split that training reads (train; valid with --eval-iters) gets at least one
    document of ``prefix``, counted as megatron-core splits it."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = IndexedDataset(prefix).sequence_lengths.shape[0]
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))
    for name, bookends in zip(("train", "validation"), matrix[:2 if args.eval_iters else 1]):
        count = 0 if bookends is None else round(bookends[1] * documents) - round(bookends[0] * documents)
        require(count > 0, "--split", args.split, f"gives the {name} part 0 of the {documents} documents of "
                f"{prefix}; give it a larger share" + (" or set --eval-iters 0" if name == "validation" else ""))


def _training_length(args) -> None:
    """--train-iters, or Megatron-LM's --train-samples (then --train-iters is derived and the LR
    schedule counts samples, with the sample-based warmup and decay flags)."""
    require((args.train_iters is None) != (args.train_samples is None), "--train-iters", args.train_iters,
            "give exactly one of --train-iters and --train-samples")
    require(args.lr_warmup_fraction is None or 0 <= args.lr_warmup_fraction <= 1 and not args.lr_warmup_iters
            and not args.lr_warmup_samples, "--lr-warmup-fraction", args.lr_warmup_fraction,
            "must be in [0, 1], without --lr-warmup-iters or --lr-warmup-samples")
    unit = "samples" if args.train_samples else "iters"
    if args.train_samples is None:
        for flag, value in (("--lr-warmup-samples", args.lr_warmup_samples),
                            ("--lr-decay-samples", args.lr_decay_samples)):
            require(not value, flag, value, "goes with --train-samples; with --train-iters use the -iters flag")
    else:
        g = args.global_batch_size
        require(args.train_samples > 0 and args.train_samples % g == 0, "--train-samples", args.train_samples,
                f"must be a positive multiple of --global-batch-size ({g})")
        for flag, value in (("--lr-warmup-iters", args.lr_warmup_iters), ("--lr-decay-iters", args.lr_decay_iters)):
            require(not value, flag, value, "goes with --train-iters; with --train-samples use the -samples flag")
        args.train_iters = args.train_samples // g
    schedule = lr_schedule(args)  # megatron-core's scheduler asserts this without naming a flag
    require(schedule["lr_warmup_steps"] < schedule["lr_decay_steps"],
            "--lr-warmup-fraction" if args.lr_warmup_fraction is not None else f"--lr-warmup-{unit}",
            schedule["lr_warmup_steps"], f"must be below the decay length, {schedule['lr_decay_steps']}"
            f" (--lr-decay-{unit}, or else --train-{unit})")


def lr_schedule(args) -> dict:
    """megatron-core's OptimizerParamScheduler settings (the ones it checks on load), in iterations or,
    with --train-samples, in samples (``lr_increment`` per iteration)."""
    if args.train_samples:
        total, decay, warmup = args.train_samples, args.lr_decay_samples or args.train_samples, args.lr_warmup_samples
    else:
        total, decay, warmup = args.train_iters, args.lr_decay_iters or args.train_iters, args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": warmup, "lr_decay_steps": decay,
            "lr_decay_style": args.lr_decay_style, "start_wd": args.weight_decay, "end_wd": args.weight_decay,
            "wd_incr_steps": total, "wd_incr_style": "constant"}


def lr_increment(args) -> int:
    return args.global_batch_size if args.train_samples else 1


_SCHEDULE_FLAG = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters/-samples/-fraction",
                  "lr_decay_steps": "--lr-decay-iters/-samples", "lr_decay_style": "--lr-decay-style",
                  "start_wd": "--weight-decay", "end_wd": "--weight-decay",
                  "wd_incr_steps": "--train-iters/-samples", "wd_incr_style": "--weight-decay"}


def _check_schedule(args, saved: dict) -> None:
    """As Megatron-LM: resuming with another LR schedule is an error unless one of the two flags says
    which schedule wins."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    for key, value in lr_schedule(args).items():
        require(saved.get(key, value) == value, _SCHEDULE_FLAG[key], value,
                f"the checkpoint in {args.load} was trained with {key} {saved.get(key)}; pass "
                f"--override-opt_param-scheduler to use this run's schedule or --use-checkpoint-opt_param-scheduler "
                f"to keep the checkpoint's")


def _first_launch(args) -> bool:
    """``--save X --load X`` with nothing at X yet: every Megatron-LM script and Slurm requeue does this,
    so it starts from scratch. A --load elsewhere with no checkpoint stays an error (a typo must not
    train from scratch silently)."""
    from ..checkpoint.checkpointing import LATEST

    same = args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
    return same and not os.path.exists(os.path.join(args.load, LATEST))


def _writable(path: str) -> bool:
    """Without creating anything: an existing writable directory, or a missing one whose nearest
    existing ancestor is a writable directory."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return os.path.isdir(path) and os.access(path, os.W_OK)
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent) and os.access(parent, os.W_OK)


def _validate_checkpoint(args) -> None:
    """--load must hold a whole checkpoint of this model's shape (sizes and common state only)."""
    from ..checkpoint.checkpointing import check_shape, check_sizes, find_checkpoint, read_common

    folder, fmt = find_checkpoint(args.load)
    check_sizes(folder, args.load)
    common = read_common(folder, fmt, args.load)
    check_shape(args, common, args.load)
    loads_optimizer = not (args.finetune or args.no_load_optim)
    require(fmt != "torch" or not loads_optimizer, "--load", args.load,
            "is a legacy torch checkpoint, whose optimizer state is not converted: pass --no-load-optim or --finetune")
    require(fmt != "torch_dist" or not loads_optimizer or "optimizer" in common, "--load", args.load,
            "holds no optimizer state (a model saved alone?): pass --no-load-optim or --finetune")
    if loads_optimizer and "opt_param_scheduler" in common:
        _check_schedule(args, common["opt_param_scheduler"])


def _validate_data(args) -> None:
    require(args.mock_data != bool(args.data_path), "--data-path", args.data_path,
            "give exactly one of --data-path and --mock-data")
    if args.data_path:
        prefixes = args.data_path[1::2] if len(args.data_path) > 1 else args.data_path
        if len(args.data_path) > 1:
            require(len(args.data_path) % 2 == 0, "--data-path", " ".join(args.data_path),
                    "a blend is pairs of WEIGHT PREFIX")
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                require(os.path.isfile(prefix + ext), "--data-path", prefix,
                        f"no such file {prefix + ext} (make it with scripts/preprocess_data.py)")
        splits = [float(x) for x in args.split.replace("/", ",").split(",")]
        require(len(splits) <= 3 and splits[0] > 0, "--split", args.split, "train,valid,test with train > 0")
        for prefix in prefixes:
            _require_documents(args, prefix)
    check_tokenizer_arguments(args, require)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _given(args) -> dict:
    """The schedule options the trainer takes as they are, by ScheduleSpec field; None if not given."""
    return {field: getattr(args, _dest(OPTION[field].trainer)) for field in SHARED}


def _schedule(args, chunks: int):
    """Our executor's schedule. A library error about a value the trainer derives (micro-batches from
    --global-batch-size) names the flag the user gave, and says what it gives."""
    spec = ScheduleSpec(args.pipeline_schedule, args.pipeline_model_parallel_size, args.num_microbatches,
                        chunks=chunks if args.pipeline_schedule == "interleaved" else None, **_given(args))
    try:
        return build_spec(spec)
    except ScheduleConfigError as e:
        option = OPTION.get(e.option)
        if option is None or not option.trainer_derives:
            raise
        rule = f"gives {e.value} {option.trainer_derives}; {e.rule}"
        raise ScheduleConfigError(option.trainer, getattr(args, _dest(option.trainer)), rule) from None


def schedule_flags(spec: ScheduleSpec, num_layers: int) -> list[str]:
    """The flags that make the trainer build ``spec`` for a model of ``num_layers``, given a global batch
    that gives its micro-batches (the benchmark runs the registry's variants with these)."""
    out = ["--pipeline-model-parallel-size", str(spec.stages), "--pipeline-schedule", spec.schedule]
    if spec.chunks:
        out += [OPTION["chunks"].trainer, str(num_layers // (spec.stages * spec.chunks))]
    for field in SHARED:
        value = getattr(spec, field)
        if value is True:
            out.append(OPTION[field].trainer)
        elif value is not None:
            out += [OPTION[field].trainer, str(value)]
    return out
