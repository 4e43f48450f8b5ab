"""Run many training cases inside one launch, to keep process starts few.

    python -m megatron.chimera.testing.equivalence --out DIR                 # the one-process references
    torchrun --nproc_per_node 2|4 -m megatron.chimera.testing.equivalence --out DIR [--only TEXT]

Every case trains a tiny GPT for ITERS (2) iterations (fp32, dropout 0, AdamW or Muon, gradient clipping) and, on
rank 0, writes DIR/cases_w<world>.json: per-iteration losses, the largest relative difference to
the reference in losses and in final weights, which copies of a stage (or of the tied embedding) were
not bitwise identical after a step, what --check-weight-hash-across-dp-replicas-interval's check found,
what evaluation changed, what the hooks saw and what each chunk holds, each beside what was expected:
the harness reports, the tests (tests/integration/test_training.py) assert. The one-process launch writes
the references (losses, evaluation loss, final weights) per model variant.

The three launches may run at once (the tests start them together): a pipeline's ranks wait on each other,
so one launch alone leaves the cores partly idle. A multi-process case waits for its reference file, which
the one-process launch writes whole (os.replace) when that reference is done, or gives up when that launch
has written REFERENCES_FAILED; each launch builds its own data-set cache, so none reads one half-written.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from chimera_schedules import Op
from chimera_schedules.analysis.nccl_model import check
from chimera_schedules.analysis.validator import validate
from chimera_schedules.ir.actions import Overlapped, parts
from chimera_schedules.ir.errors import InvalidSchedule
from chimera_schedules.passes.lowering import lower
from chimera_schedules.passes.overlap import REFERENCE, halve
from megatron.chimera import Hooks, Trainer, job_config, make_run_plan, parse_args
from megatron.chimera.config.run_plan import PROOF_MODE
from megatron.chimera.distributed.weight_hashes import WeightHashMismatch
from megatron.chimera.model.gpt_step import forward_step
from megatron.chimera.model.parameter_names import global_name, is_gated, tp_shard
from megatron.chimera.observability.series import validation_ppl
from megatron.chimera.testing.cases import process_state_kept
from megatron.chimera.testing.parsing import read_field_docstrings_once

ITERS = 2
MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "128", "--hidden-dropout", "0",
         # one padded vocabulary (128) at TP = 1 and 2: megatron-core 0.19's NullTokenizer has exactly
         # --vocab-size ids, which Megatron pads to a multiple of 128 x TP by default
         "--make-vocab-size-divisible-by", "64",
         "--attention-dropout", "0", "--lr", "1e-3", "--mock-data", "--num-workers", "0", "--train-iters", str(ITERS),
         "--global-batch-size", "8", "--eval-iters", "1", "--eval-interval", "1000", "--seed", "4321",
         # Biases off: the key bias has an exactly-zero true gradient, and AdamW turns its rounding noise
         # (~1e-10, below eps) into layout-dependent updates, in any layout. Losses agree either way. (Its
         # rounding noise is also exactly zero in some layouts and not others: num zeros would differ.)
         "--disable-bias-linear",
         # Megatron-LM's series over the logical model, each stage once however many copies a layout holds
         "--log-params-norm", "--log-num-zeros-in-grad"]
MIXTRAL = ["--normalization", "RMSNorm", "--swiglu", "--num-experts", "8", "--moe-router-topk", "2",
           "--moe-ffn-hidden-size", "32", "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "allgather"]
VARIANTS = {"tied-learned": [], "untied": ["--untie-embeddings-and-output-weights"],
            "rope": ["--position-embedding-type", "rope"],
            # Llama's architecture flags as Megatron-LM's Llama recipes spell them (biases are off for all)
            "llama": ["--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--group-query-attention",
                      "--num-query-groups", "2", "--use-rotary-position-embeddings", "--no-position-embedding",
                      "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-5"],
            "qk-layernorm": ["--qk-layernorm", "--normalization", "RMSNorm"],  # LayerNorm's key bias has zero gradient
            # Megatron-LM's --fp16, its loss scale low enough that no iteration overflows
            "fp16": ["--fp16", "--initial-loss-scale", "4096"],
            "bf16": ["--bf16"],  # Megatron-LM's: bf16 weights, fp32 main weights and gradients, no loss scale
            # Mixtral's MoE flags as Megatron-LM's Mixtral recipe spells them, scaled down (no token dropped)
            "mixtral": MIXTRAL,
            # the same with a capacity: tokens past it are dropped, the same ones in every layout
            "mixtral-capacity": MIXTRAL + ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "probs"],
            # DeepSeek's: first layer dense, a shared expert, sigmoid routing with expert bias (aux-loss-free
    # balancing; a high update rate so the bias moves the routing within the test's 2 iterations),
    # group-limited top-k, multi-latent attention
            "deepseek-style": ["--normalization", "RMSNorm", "--swiglu", "--num-experts", "8", "--moe-router-topk", "2",
                               "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0]+[1]*7",
                               "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
                               "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                               "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
                               "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16",
                               "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
                               "--kv-channels", "8", "--qk-layernorm", "--position-embedding-type", "rope",
                               "--moe-router-topk-scaling-factor", "2.5", "--moe-router-load-balancing-type",
                               "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"]}
# DeepSeek-V3's multi-token prediction (Megatron-LM requires rope with it), on the dense GPT and on Mixtral
MTP = ["--position-embedding-type", "rope", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]
VARIANTS |= {"mtp": MTP, "mtp-untied": MTP + ["--untie-embeddings-and-output-weights"], "mixtral-mtp": MIXTRAL + MTP}
# megatron-core's other balancing: S-BASE's Sinkhorn routing (no auxiliary loss), and the global auxiliary loss,
# whose token counts run over the micro-batches each router has seen in the iteration. Under Chimera each copy
# of a stage sees its own pipeline's only: the reference for it (PER_PIPELINE) restarts the counts at each
# pipeline's first micro-batch (restart_counts_per_pipeline), the one process that Chimera equals.
GLOBAL_AUX = MIXTRAL + ["--moe-router-load-balancing-type", "global_aux_loss"]
PER_PIPELINE = "mixtral-global-aux-per-pipeline"
SINKHORN = MIXTRAL + ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"]
VARIANTS |= {"mixtral-sinkhorn": SINKHORN, "mixtral-global-aux": GLOBAL_AUX, PER_PIPELINE: GLOBAL_AUX}
# Mixtral balanced per sequence (seq_aux_loss, and the z-loss: means over sequences and tokens, whatever the
# micro-batch size), over a global batch of 16: --overlap-moe-expert-parallel-comm runs actions in two halves
# of micro-batches of 2 or 4 against it, where another micro-batch's loss would differ (aux_loss is refused)
SEQ_AUX = "mixtral-seq-aux"
VARIANTS[SEQ_AUX] = MIXTRAL + ["--moe-router-load-balancing-type", "seq_aux_loss", "--global-batch-size", "16"]
# Balanced without a statistic of the whole sequence (expert bias, the z-loss), with rope: at micro-batch size 1
# --overlap-moe-expert-parallel-comm runs actions as the two halves of each sequence (model/sequence_halves.py),
# whose second half attends to the first's keys at positions after them (N = D at 4 sequences, N = 2D at 8)
SEQUENCE_HALVES = MIXTRAL + ["--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0",
                             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                             "--moe-router-bias-update-rate", "1e-2", "--position-embedding-type", "rope"]
VARIANTS |= {"mixtral-rope-bias-4": SEQUENCE_HALVES + ["--global-batch-size", "4"],
             "mixtral-rope-bias-8": SEQUENCE_HALVES + ["--global-batch-size", "8"]}
# Qwen3-Next's shared expert, its output scaled by a sigmoid gate of the token (--moe-shared-expert-gate: one
# weight row per layer, megatron-core's SharedExpertMLP.gate_weight)
VARIANTS["shared-expert-gate"] = MIXTRAL + ["--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]

# Megatron-LM's current model recipes (recipes/moe/, issue 34), each family's model-definition flags
# scaled to MODEL, dropout off (Megatron-LM seeds dropout by pipeline rank)
QWEN3 = ["--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--group-query-attention",
         "--num-query-groups", "2", "--kv-channels", "8", "--qk-layernorm", "--untie-embeddings-and-output-weights",
         "--position-embedding-type", "rope", "--rotary-percent", "1.0", "--rotary-base", "1000000"]
ROUTED = ["--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall"]
SIGMOID_SHARED = ["--moe-router-score-function", "sigmoid", "--moe-shared-expert-intermediate-size", "16",
                  "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-drop-policy", "probs"]
LATENT = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8",
          "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--kv-channels", "8", "--qk-layernorm",
          "--rotary-percent", "1.0", "--mscale", "1.0", "--mscale-all-dim", "1.0"]
# multi-latent attention on the dense GPT, for tensor parallelism without sequence parallelism (LatentSelfAttention's
# path that sums the key's position gradient itself; each rank normalises the whole latent: mark_tensor_parallel_sums).
# With it (the path MoE takes) the same model and the DeepSeek-style one at Chimera D=2 x TP=2 equal one process too,
# checked by hand and left out of the suite for its time (about 2x and 4x a dense TP=2 case)
VARIANTS["mla"] = LATENT + ["--position-embedding-type", "rope", "--normalization", "RMSNorm"]
DENSE_GLU = ["--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
             "--position-embedding-type", "rope", "--ffn-hidden-size", "64"]
FAMILIES = {
    "qwen3": QWEN3,
    "qwen3-moe": QWEN3 + ROUTED + ["--num-experts", "8", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
                                   "--moe-aux-loss-coeff", "1e-3", "--moe-router-load-balancing-type", "aux_loss",
                                   "--moe-layer-recompute", "--rotary-seq-len-interpolation-factor", "2"],
    "kimi-k2": DENSE_GLU + LATENT + ROUTED + SIGMOID_SHARED + [
        "--num-experts", "8", "--moe-layer-freq", "[0]*1+[1]*7", "--moe-ffn-hidden-size", "16",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2", "--moe-router-topk", "2",
        "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor", "2.827", "--moe-shared-expert-overlap",
        "--moe-aux-loss-coeff", "1e-4", "--rotary-base", "50000", "--rotary-scaling-factor", "32",
        "--padded-vocab-size", "192", "--recompute-activations", "--moe-layer-recompute"],
    "llama4-scout": DENSE_GLU + ROUTED + SIGMOID_SHARED + [
        "--group-query-attention", "--num-query-groups", "2", "--qk-layernorm", "--num-experts", "8",
        "--moe-ffn-hidden-size", "16", "--moe-router-topk", "1", "--moe-router-topk-scaling-factor", "1.0",
        "--moe-aux-loss-coeff", "1e-3", "--rotary-interleaved", "--rotary-percent", "1.0", "--rotary-base", "500000",
        "--rope-scaling-factor", "8.0", "--use-rope-scaling"],
    "deepseek-v3": DENSE_GLU + LATENT + ROUTED + SIGMOID_SHARED + [
        "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
        "--norm-epsilon", "1e-6", "--rotary-base", "10000", "--num-experts", "8", "--moe-layer-freq", "[0]*3+[1]*5",
        "--moe-ffn-hidden-size", "16", "--moe-router-topk", "4", "--moe-router-pre-softmax", "--moe-grouped-gemm",
        "--moe-aux-loss-coeff", "1e-4", "--moe-router-group-topk", "2", "--moe-router-num-groups", "4",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        "1e-2", "--rotary-scaling-factor", "40", "--recompute-granularity", "selective", "--recompute-modules", "mlp",
        "moe", "mla_up_proj", "layernorm", "--no-check-for-nan-in-loss-and-grad", "--init-method-std", "0.02"],
    "gpt-oss": ["--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--rope-type", "rope",
                "--position-embedding-type", "rope", "--rotary-base", "10000", "--rotary-percent", "1.0",
                "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64", "--quick-geglu",
                "--glu-linear-offset", "1.0", "--softmax-type", "learnable", "--window-attn-skip-freq", "2",
                "--activation-func-clamp-value", "7.0", "--window-size", "4,0", "--num-experts", "4",
                "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff",
                "1e-3", "--moe-grouped-gemm", "--moe-ffn-hidden-size", "32", "--moe-z-loss-coeff", "1e-3"] + ROUTED,
}
VARIANTS |= FAMILIES
# Muon (megatron-core's, Megatron-LM's defaults otherwise): Newton-Schulz in fp32 (the default, medium, runs it
# in bf16), and a TP-split matrix orthogonalised whole, gathered over the TP group (the default, blockwise,
# orthogonalises each shard, which one process cannot equal)
VARIANTS["muon"] = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--muon-tp-mode", "duplicated"]
# Megatron-LM flags whose meaning is a field of megatron-core's config, at once: query-key layer scaling (each
# chunk numbers its layers from its first, which only rounds differently), an attention output gate, squared
# ReLU, L2-normalised queries and keys, the embeddings' own init std, RoPE skipped on layers 4, 5 (one on each
# side of the D=2 split) and 8
VARIANTS["config-fields"] = ["--apply-query-key-layer-scaling", "--attention-output-gate", "--squared-relu",
                             "--qk-l2-norm", "--embedding-init-method-std", "0.01", "--position-embedding-type",
                             "rope", "--no-rope-freq", "[0]*3+[1]*2+[0]*2+[1]"]


# How close a layout must come to the one-process reference (docs/equivalence_bounds.md derives each).
#
# fp32: layouts differ only in the order of fp32 sums, so the losses agree within 1e-6. The weights are
# compared in the space AdamW moves them in: RMS differences in units of a full step (the learning
# rates of the steps taken). AdamW's u = m/(sqrt(v)+eps) moves an element by at most |dg|/eps of a step
# for a rounding difference dg of its gradient, and by a quarter of dg/g where g is well above eps;
# fp32's ~1e-10 noise is ~1e-2 of eps, so no tensor's RMS exceeds 1e-2 of a step, and the noise-floor
# elements, under 1% of a model, keep the whole model within 1e-3. A weight that misses its updates
# is ~0.75 of a step away: the planted bug (DROPPED_EXPERT) lands at ~0.75 on its tensor, and ~0.08
# on the whole model, and is checked to fail. The relative weight differences are reported too.
#
# fp16 and bf16 (Megatron's: fp32 main weights and gradients, the model's weights rounded to the
# format after every step). Let u be the format's unit roundoff, 2^-11 for fp16 and 2^-8 for bf16, and
# k = ITERS the number of steps.
# - Weights. A layout's fp32 main weights agree with the reference's to fp32 precision, far below the
#   format's spacing, and each side rounds to nearest, so after a step every low-precision weight is
#   the reference's or its neighbour: |dw| <= 2u|w|. Tensor parallelism also rounds its partial sums in
#   the format, which is a perturbation of the same size. Rounded afresh each step, the differences
#   add up over k steps at most: whole model <= 2ku, relative.
# - Losses. To first order a relative perturbation of at most 2u in every weight moves the loss by
#   at most 2u * sum_i |w_i dL/dw_i| = 2u * kappa * L, where kappa is the loss's condition number with
#   respect to the weights. The fp32 references measure kappa after every step (kappa_rel, checked
#   <= KAPPA_MAX = 1/2 in test_training; 0.31 for this GPT and 0.25 for the Llama variant), so each
#   step adds at most u to the relative loss difference: losses and evaluation <= ku.
# - Before the first update there is no rounding difference yet: without tensor parallelism the first
#   loss is the reference's arithmetic, within fp32's 1e-6 (checked too).
# - The worst single tensor is not bounded by the format's rounding in steps (a weight rounded to its
#   neighbour moves by 2u|w|, which may be many steps), so it is reported, not asserted.
# Measured on one CPU at k = 3 (bf16 / fp16, Chimera D=2): losses 5.5e-6 / 1.6e-6 against ku = 1.2e-2 / 1.5e-3;
# weights 7.5e-5 / 1.6e-5 against 2ku = 2.3e-2 / 2.9e-3; fp16 at TP=2 2.6e-4. The harness now takes k = 2
# (two steps: the second already starts from updated weights and optimizer state): ku = 7.8e-3 / 9.8e-4.
KAPPA_MAX = 0.5
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


class Bounds(NamedTuple):
    """A precision's bounds; None: reported, not asserted. ``*_steps`` in AdamW steps (RMS), the rest relative."""

    losses: float
    model_rel: float | None
    model_steps: float | None
    tensor_steps: float | None
    evaluation: float


TOLERANCE = {"fp32": Bounds(1e-6, None, 1e-3, 1e-2, 1e-6),
             **{fmt: Bounds(ITERS * u, 2 * ITERS * u, None, None, ITERS * u) for fmt, u in UNIT_ROUNDOFF.items()}}


DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = ["--overlap-grad-reduce"]  # Megatron-LM's: off by default, every reduction after the schedule


EP2 = ["--expert-model-parallel-size", "2"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
MOE_OVERLAP = ["--overlap-moe-expert-parallel-comm"]


LAYOUT = "--pipeline-model-parallel-layout"
TP2 = ["--tensor-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]


def schedule_cases(d: int) -> dict[str, list[str]]:
    """Every schedule at D=2; at D=4 those whose order changes with D (GPipe's, megatron-core's 1F1B, DualPipeV's
    and Chimera's best order at D=4, under the NCCL emulation below, would only repeat D=2's code paths)."""
    pp = ["--pipeline-model-parallel-size", str(d), "--micro-batch-size", "1"]
    vpp = ["--num-layers-per-virtual-pipeline-stage", str(8 // (2 * d))]
    two_only = {
        f"gpipe D={d}": pp + ["--pipeline-schedule", "gpipe"],
        f"megatron-1f1b D={d}": pp + ["--pipeline-schedule", "megatron-1f1b"],
        f"dualpipev D={d}": pp + ["--pipeline-schedule", "dualpipev"],
        f"chimera best D={d}": pp + ["--pipeline-schedule", "chimera", "--chimera-order", "best"]}
    return {
        f"1f1b D={d}": pp + ["--pipeline-schedule", "1f1b"],
        f"interleaved v=2 D={d}": pp + ["--pipeline-schedule", "interleaved"] + vpp,
        f"chimera direct D={d}": pp + ["--pipeline-schedule", "chimera"],
        f"chimera doubling D={d}": pp + ["--pipeline-schedule", "chimera", "--chimera-concat", "doubling"],
        f"1f1b split D={d}": pp + ["--pipeline-schedule", "1f1b", "--split-backward"],
        f"chimera split D={d}": pp + ["--pipeline-schedule", "chimera", "--split-backward"],
        f"dualpipe D={d}": pp + ["--pipeline-schedule", "dualpipe"],
    } | (two_only if d == 2 else {}) | successor_cases(d)


def successor_cases(d: int) -> dict[str, list[str]]:
    """Chimera's successors (docs/schedules.md): the V schedules and BitPipe at D=2 (4 and 8 model stages of
    the 8 layers), Hanayo's waves at D=2 and D=4, BitPipe at D=4 too."""
    pp = ["--pipeline-model-parallel-size", str(d), "--micro-batch-size", "1", "--pipeline-schedule"]
    if d == 2:
        return {f"{name} D=2": pp + [name] for name in ("v-min", "v-half", "v-zb", "bitpipe")} | {
            "hanayo 2 waves D=2": pp + ["hanayo", "--hanayo-waves", "2"]}
    return {"hanayo D=4": pp + ["hanayo"], "bitpipe D=4": pp + ["bitpipe"]}


D2, D4 = schedule_cases(2), schedule_cases(4)
AUTO2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto"]
CHIMERA2, CHIMERA4 = D2["chimera direct D=2"], D4["chimera direct D=4"]

# Uneven stages (Megatron-LM's layout flags, stages holding only E or only L) and multi-token prediction,
# on the last stage or on a stage of its own, under Chimera, DualPipe(V), split backward and megatron-core's
# 1F1B: name -> (reference variant, flags)
LAYOUT_CASES = {
    2: {"layout E|ttt|tttt|tL dualpipev D=2": ("tied-learned", D2["dualpipev D=2"] + [LAYOUT, "E|ttt|tttt|tL"]),
        "mtp-untied first=3 chimera split D=2": (
            "mtp-untied", D2["chimera split D=2"] + ["--decoder-first-pipeline-num-layers", "3"]),
        "mtp layout Ettttt|tttmL distributed optimizer chimera D=2": (
            "mtp", CHIMERA2 + [LAYOUT, "Ettttt|tttmL"] + DISTOPT),
        "mtp megatron-1f1b D=2": ("mtp", D2["megatron-1f1b D=2"]),
        "mixtral-mtp chimera D=2": ("mixtral-mtp", CHIMERA2)},
    4: {"layout E|tttt|tttt|L chimera D=4": ("tied-learned", CHIMERA4 + [LAYOUT, "E|tttt|tttt|L"]),
        "mtp layout Ett|ttt|tttm|L chimera D=4": ("mtp", CHIMERA4 + [LAYOUT, "Ett|ttt|tttm|L"]),
        "mtp layout Ettt|t|tt|ttmL dualpipe D=4": ("mtp", D4["dualpipe D=4"] + [LAYOUT, "Ettt|t|tt|ttmL"])},
}

# The overlap pass keeps only the pairs that pay (passes/overlap.py), and at D=2 no forward sits next to
# another micro-batch's I under Chimera split: this case fuses every adjacent independent pair of 1F1B
# split instead, so that the executor's F&I (a forward beside an I, its W later) runs on a real model.
EVERY_PAIR = "mixtral overlap 1f1b split D=2 EP=2 every pair fused"

# --overlap-moe-expert-parallel-comm with actions in halves (SEQ_AUX's global batch of 16 over DP=2): name ->
# (schedule case, micro-batch size)
# --overlap-param-gather under schedule plans: megatron-core's plan runs a chunk's submodules, never the chunk,
# so each forward waits for its weights at the submodules (three schedules: 1F1B's pairs, and the two below)
GATHER_OVERLAPPED = DISTOPT + OVERLAP + ["--overlap-param-gather"]
HALVES_CASES = {"mixtral overlap chimera direct D=2 N=D halves EP=2": ("chimera direct D=2", "4", []),
                "mixtral overlap chimera split D=2 halves EP=2": ("chimera split D=2", "2", []),
                "mixtral overlap dualpipev D=2 halves overlapped gather EP=2": (
                    "dualpipev D=2", "2", GATHER_OVERLAPPED),
                "mixtral overlap chimera direct D=2 N=2D pairs and halves overlapped gather EP=2": (
                    "chimera direct D=2", "2", GATHER_OVERLAPPED)}
# ... and at micro-batch size 1, in halves of each sequence: name -> (reference variant, schedule case)
SEQUENCE_HALVES_CASES = {
    "mixtral overlap chimera direct D=2 N=D sequence halves EP=2": ("mixtral-rope-bias-4", "chimera direct D=2"),
    "mixtral overlap chimera split D=2 sequence halves EP=2": ("mixtral-rope-bias-8", "chimera split D=2"),
    "mixtral overlap dualpipev D=2 sequence halves EP=2": ("mixtral-rope-bias-8", "dualpipev D=2")}
MTP_PAIRED = "mixtral-mtp overlap dualpipev D=2 EP=2"
# the cases with every pair fused (every_pair_fused): at micro-batch size 1 pairs only, at 2 pairs and halves
PAIRS_FORCED = (EVERY_PAIR, "mixtral overlap dualpipev D=2 halves overlapped gather EP=2",
                "mixtral overlap chimera direct D=2 N=2D pairs and halves overlapped gather EP=2")

# A planted bug, to show the fp32 weight bounds catch one: global expert 0 of layer 3 never updates (its
# gradient is zeroed in every backward, on every copy). test_training checks that it fails them.
DROPPED_EXPERT = "mixtral chimera D=2 planted bug: expert 0's gradient dropped"

# --deterministic-mode on the CPU (docs/megatron.md, "Determinism")
DETERMINISTIC = "chimera direct D=2 deterministic mode"
# --check-weight-hash-across-dp-replicas-interval's check runs after every case; in this one the last rank then
# perturbs one weight of its last chunk (stage 0 of the second pipeline: rank 3 holds pipeline 1's stage 0), and the
# check must name that stage and rank (both pipelines, two data-parallel replicas, experts spread over EP=2)
PLANTED_COPY = "mixtral chimera distributed optimizer D=2 EP=2 overlapped reduce"
# --overlap-grad-reduce with experts over EP=2 and a tied embedding under Chimera D=2, without and with the
# distributed optimizer: the expert and embedding reductions start in the lowered lists
OVERLAPPED_EXPERTS = ("mixtral alltoall chimera D=2 EP=2 emulated NCCL overlapped reduce", PLANTED_COPY)

# What the one-process launch writes into --out when it fails, so that no launch waits for its references
REFERENCES_FAILED = "references failed"

# Every case, by the number of processes that runs it: name -> (reference variant, flags)
CASES = {
    1: {f"reference {v}": (v, ["--micro-batch-size", "1"]) for v in VARIANTS},
    2: {name: ("tied-learned", flags) for name, flags in D2.items()} | {
        "1f1b D=2 emulated NCCL": ("tied-learned", D2["1f1b D=2"] + ["--emulate-nccl"]),
        # untied: the input embedding's rows of tokens the batch lacks have exactly zero gradient, so
        # num zeros counts something that every layout shares (and a copy counted twice would show)
        "chimera untied D=2": ("untied", CHIMERA2),
        "chimera fp16 D=2": ("fp16", CHIMERA2),
        "chimera bf16 D=2": ("bf16", CHIMERA2),
        "chimera halving D=2": ("tied-learned", ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                                                 "--pipeline-schedule", "chimera", "--chimera-concat", "halving"]),
        "mixtral chimera D=2": ("mixtral", CHIMERA2),
        DROPPED_EXPERT: ("mixtral", CHIMERA2),
        "mixtral 1f1b split D=2": ("mixtral", D2["1f1b split D=2"]),
        "mixtral sinkhorn chimera D=2": ("mixtral-sinkhorn", CHIMERA2),
        "mixtral global aux loss 1f1b D=2": ("mixtral-global-aux", D2["1f1b D=2"]),
        "mixtral global aux loss chimera D=2": (PER_PIPELINE, CHIMERA2),
        "mixtral capacity chimera D=2": ("mixtral-capacity", CHIMERA2),
        "shared-expert-gate chimera D=2": ("shared-expert-gate", CHIMERA2),
        "deepseek-style chimera split D=2": ("deepseek-style", D2["chimera split D=2"]),
        "qwen3 chimera D=2": ("qwen3", CHIMERA2),
        "muon chimera D=2": ("muon", CHIMERA2),
        "config-fields chimera D=2": ("config-fields", CHIMERA2),
        # the same run as "chimera direct D=2": test_training checks its losses and weights bitwise equal
        DETERMINISTIC: ("tied-learned", CHIMERA2 + ["--deterministic-mode"]),
        # the planner's pick (schedule, options, micro-batch size) for this model: config/auto_plan.py
        "auto D=2": ("tied-learned", AUTO2),
    } | LAYOUT_CASES[2],
    4: {name: ("tied-learned", flags) for name, flags in D4.items()} | {
        "chimera direct D=4 emulated NCCL overlapped reduce": ("tied-learned", CHIMERA4 + ["--emulate-nccl"] + OVERLAP),
        "chimera best D=4 emulated NCCL": ("tied-learned", CHIMERA4 + ["--chimera-order", "best", "--emulate-nccl"]),
        "chimera 4 pipelines D=4": ("tied-learned", CHIMERA4 + ["--chimera-pipelines", "4"]),
        "chimera D=2 DP=2 overlapped reduce": ("tied-learned", CHIMERA2 + OVERLAP),
        "chimera D=2 TP=2": ("tied-learned", CHIMERA2 + TP2),
        "muon chimera D=2 TP=2": ("muon", CHIMERA2 + TP2),
        # megatron-core's layer-wise distributed optimizer: each weight stepped by one of its 4 copies' ranks
        "muon distributed optimizer chimera D=2 DP=2": ("muon", CHIMERA2 + DISTOPT),
        # ranks in Megatron-LM's other order: rank = tp + TP x (worker + PP x dp)
        "chimera split D=2 DP=2 tp-pp-dp mapping": (
            "tied-learned", CHIMERA2 + ["--split-backward", "--use-tp-pp-dp-mapping"]),
        "chimera split D=2 TP=2": ("tied-learned", CHIMERA2 + ["--split-backward"] + TP2),
        "chimera llama D=4": ("llama", CHIMERA4),
        "chimera fp16 D=2 TP=2": ("fp16", CHIMERA2 + TP2),
        "chimera qk-layernorm D=2 TP=2": ("qk-layernorm", CHIMERA2 + TP2),
        "chimera llama D=2 TP=2": ("llama", CHIMERA2 + TP2),
        "chimera llama D=2 TP=2 sequence parallel": ("llama", CHIMERA2 + TP2 + ["--sequence-parallel"]),
        "chimera distributed optimizer D=4": ("tied-learned", CHIMERA4 + DISTOPT),
        "chimera distributed optimizer D=2 DP=2": ("tied-learned", CHIMERA2 + DISTOPT),
        # Megatron's partial distributed optimizer: each stage's 4 copies as 2 instances of 2 shards
        "chimera distributed optimizer D=2 DP=2 2 instances": (
            "tied-learned", CHIMERA2 + DISTOPT + ["--num-distributed-optimizer-instances", "2"]),
        "chimera distributed optimizer overlapped gather D=4": (
            "tied-learned", CHIMERA4 + DISTOPT + OVERLAP + ["--overlap-param-gather"]),
        "chimera distributed optimizer D=2 TP=2": ("tied-learned", CHIMERA2 + DISTOPT + TP2),
        "chimera fp16 distributed optimizer D=2 DP=2": ("fp16", CHIMERA2 + DISTOPT),
        "chimera bf16 distributed optimizer D=2 DP=2": ("bf16", CHIMERA2 + DISTOPT),
        "chimera llama distributed optimizer D=2 TP=2 sequence parallel": (
            "llama", CHIMERA2 + DISTOPT + TP2 + ["--sequence-parallel"]),
        "1f1b distributed optimizer D=2 DP=2": ("tied-learned", D2["1f1b D=2"] + DISTOPT),
        # the successors with TP=2 and the distributed optimizer over their stage copies and replicas
        "bitpipe D=2 TP=2": ("tied-learned", D2["bitpipe D=2"] + TP2),
        "v-half D=2 TP=2": ("tied-learned", D2["v-half D=2"] + TP2),
        "bitpipe distributed optimizer D=2 DP=2": ("tied-learned", D2["bitpipe D=2"] + DISTOPT),
        "v-zb distributed optimizer D=2 DP=2": ("tied-learned", D2["v-zb D=2"] + DISTOPT),
        # megatron-core's schedules with Megatron-LM's overlap hooks (its interleaved one needs PP > 2: at
        # 4 processes no replicas to reduce over, but the hooks' calls are counted; 1F1B has a DP=2 replica)
        "megatron-interleaved v=2 D=4 distributed optimizer overlapped reduce and gather": (
            "tied-learned", ["--pipeline-model-parallel-size", "4", "--micro-batch-size", "1",
                             "--pipeline-schedule", "megatron-interleaved",
                             "--num-layers-per-virtual-pipeline-stage", "1"] + DISTOPT + OVERLAP
            + ["--overlap-param-gather"]),
        "megatron-1f1b D=2 DP=2 overlapped reduce": ("tied-learned", D2["megatron-1f1b D=2"] + OVERLAP),
        "mixtral chimera D=4": ("mixtral", CHIMERA4),
        "mixtral dualpipe D=4": ("mixtral", D4["dualpipe D=4"]),
        OVERLAPPED_EXPERTS[0]: ("mixtral", CHIMERA2 + EP2 + ALLTOALL + ["--emulate-nccl"] + OVERLAP),
        PLANTED_COPY: ("mixtral", CHIMERA2 + EP2 + DISTOPT + OVERLAP),
        "deepseek-style chimera D=4": ("deepseek-style", CHIMERA4),
        "deepseek-style chimera split D=2 EP=2": ("deepseek-style", CHIMERA2 + EP2 + ["--split-backward"]),
        "mla chimera D=2 TP=2": ("mla", CHIMERA2 + TP2),
        # MTP's own norms (embedding, hidden states, last) under sequence parallelism: Megatron-LM's MoE configs
        "mtp chimera D=2 TP=2 sequence parallel": ("mtp", CHIMERA2 + TP2 + ["--sequence-parallel"]),
        # context parallelism: each CP rank holds 2 of the sequence's 4 chunks, its attention over the keys and
        # values gathered from both (model/context_parallel.py); RoPE and query groups split with it (llama);
        # EP over the two CP ranks of each stage, as megatron-core allows (its expert groups tile TP x CP x DP);
        # under the NCCL emulation the CP group's gathers inside F and B run on a communicator warmed up; the
        # distributed optimizer shards each stage over both pipelines' copies x CP; TP x CP with sequence parallelism
        "chimera D=2 CP=2 emulated NCCL distributed optimizer overlapped reduce": (
            "tied-learned", CHIMERA2 + CP2 + ["--emulate-nccl"] + DISTOPT + OVERLAP),
        "llama TP=2 CP=2 sequence parallel": (
            "llama", ["--micro-batch-size", "1"] + CP2 + TP2 + ["--sequence-parallel"]),
        # ... and Transformer Engine's types asked for per layer (each stage its slice): the same attention here
        "chimera split llama D=2 CP=2 per-layer comm types": ("llama", D2["chimera split D=2"] + CP2 + [
            "--cp-comm-type", *["p2p", "a2a", "all_gather", "p2p"] * 2]),
        "mixtral alltoall chimera D=2 CP=2 EP=2": ("mixtral", CHIMERA2 + CP2 + EP2 + ALLTOALL),
        # the micro-batch size given (auto keeps it): the auxiliary loss balances each micro-batch, so a plan at
        # another size would train another model than the one-process reference at 1
        "mixtral alltoall auto D=2 EP=2": ("mixtral", AUTO2 + EP2 + ALLTOALL + ["--micro-batch-size", "1"]),
    # --overlap-moe-expert-parallel-comm: every schedule that takes it, each F&B run through megatron-core's
    # schedule plans, the expert all-to-all between the two EP=2 ranks of each stage. At micro-batch size 1
    # the pairs only (1F1B, DualPipe; EVERY_PAIR: 1F1B split with its I passes paired); at 2 or 4 actions in
    # halves too (HALVES_CASES: Chimera at N = D, whose every action runs in halves; Chimera split at N = 4,
    # halved F and I; DualPipeV at N = 4, halves and pairs)
    } | {"mixtral overlap 1f1b D=2 overlapped gather EP=2": (
        "mixtral", D2["1f1b D=2"] + EP2 + ALLTOALL + MOE_OVERLAP + GATHER_OVERLAPPED),
         "mixtral overlap dualpipe D=2 EP=2": ("mixtral", D2["dualpipe D=2"] + EP2 + ALLTOALL + MOE_OVERLAP),
         # multi-token prediction's layer in megatron-core's plan, paired (MTP turns halves off)
         MTP_PAIRED: ("mixtral-mtp", D2["dualpipev D=2"] + EP2 + ALLTOALL + MOE_OVERLAP)} | {
        name: (SEQ_AUX, D2[schedule] + EP2 + ALLTOALL + MOE_OVERLAP + ["--micro-batch-size", mbs] + more)
        for name, (schedule, mbs, more) in HALVES_CASES.items()} | {
        name: (variant, D2[schedule] + EP2 + ALLTOALL + MOE_OVERLAP + ["--micro-batch-size", "1"])
        for name, (variant, schedule) in SEQUENCE_HALVES_CASES.items()} | {
        EVERY_PAIR: ("mixtral", D2["1f1b split D=2"] + EP2 + ALLTOALL + MOE_OVERLAP),
    # the MoE families; gpt-oss with an odd first stage, so that each stage's slice of its window pattern
    # (every other layer) matters
    } | {f"{family} chimera D=2 EP=2": (family, CHIMERA2 + EP2 + (
        ["--decoder-first-pipeline-num-layers", "3"] if family == "gpt-oss" else []))
         for family in FAMILIES if family != "qwen3"} | LAYOUT_CASES[4],
}


def cases(world: int) -> dict[str, tuple[str, list[str]]]:
    """name -> (reference variant, flags), for the cases that fill ``world`` processes; the one-process
    references that the other launches need, in the order they first need them, so that neither waits idle."""
    if world > 1:
        return dict(CASES[world])
    needed = {variant for w in (2, 4) for variant, _ in CASES[w].values()}
    return dict(sorted(((name, case) for name, case in CASES[1].items() if case[0] in needed),
                       key=lambda item: _first_use(item[1][0])))


def _first_use(variant: str) -> int:
    """The earliest place, in either multi-process launch's order, of a case compared with ``variant``."""
    return min(i for world in (2, 4) for i, (v, _) in enumerate(CASES[world].values()) if v == variant)


def local_weights(trainer) -> dict[tuple[str, int], torch.Tensor]:
    """Every parameter, and every router's expert bias (aux-loss-free balancing moves it), by global name."""
    trainer.main.flush()  # --overlap-param-gather leaves the last gather to the next forward
    out = {(p.global_name, trainer.rt.tp_rank): p.detach().clone() for m in trainer.models for p in m.parameters()}
    for m in trainer.models:
        first = trainer.plan.layout.first_layer(m.stage)
        for name, bias in m.named_buffers():
            if name.endswith("expert_bias"):
                out[(global_name(name, first, False), trainer.rt.tp_rank)] = bias.detach().clone()
    return out


def layout_held(trainer) -> dict[str, dict[str, dict]]:
    """What every chunk on every rank holds, read from its parameters' names, beside what the plan's layout
    names: its transformer layers (by their number in the model), the embedding where E is (or MTP, which
    embeds the next tokens), the output layer where L is (tied at the first stage, it is the embedding
    itself, and so is MTP's embedding beside it), its MTP layers, and the final norm after the model's
    last layer. A layout that was silently ignored would still train like one process; this would show it.
    Returns {"rank r chunk i (stage s)": {"held": ..., "expected": ...}} over every rank."""
    args = trainer.job.megatron_args
    layout, tied = trainer.plan.layout, not args.untie_embeddings_and_output_weights
    mine = {}
    for i, m in enumerate(trainer.models):
        st, first = layout.stages[m.stage], layout.first_layer(m.stage)
        names = [p.global_name for p in m.parameters()]
        local = [n for n, _ in m.named_parameters()]
        held = {"layers": sorted({int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")}),
                "embedding": any(n.startswith("embedding.") for n in local),
                "output layer": "output_layer.weight" in local,
                "mtp layers": len({n.split(".")[2] for n in local if n.startswith("mtp.layers.")}),
                "final norm": any(n.startswith("decoder.final_layernorm.") for n in local)}
        expected = {"layers": list(range(first, first + st.layers)),
                    "embedding": bool(st.embedding or st.mtp > 0),
                    "output layer": bool(st.loss and not ((st.embedding or st.mtp) and tied)),
                    "mtp layers": st.mtp,
                    "final norm": bool(layout.holds_last_layer(m.stage) if args.mtp_num_layers else st.loss)}
        mine[f"rank {dist.get_rank()} chunk {i} (stage {m.stage})"] = {"held": held, "expected": expected}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {chunk: v for per_rank in every for chunk, v in per_rank.items()}


def copies_differing(trainer) -> list[str]:
    """The parameters (global name and TP shard) whose copies on different ranks are not bitwise equal;
    none should be."""
    digests = {k: hashlib.sha1(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
               for k, v in local_weights(trainer).items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digests)
    seen, differing = {}, set()
    for per_rank in gathered:
        for (name, tp_rank), digest in per_rank.items():
            if seen.setdefault((name, tp_rank), digest) != digest:
                differing.add(f"{name} (TP rank {tp_rank})")
    return sorted(differing)


def compare_weights(weights: dict, reference: dict, tp: int, config, lr_sum: float) -> dict[str, float]:
    """The weights' difference to the reference: relative (``model_rel`` the whole model's, ``tensor_rel``
    the worst tensor's) and in AdamW steps (RMS in units of ``lr_sum``, the learning rates of the steps
    taken: ``model_steps``, ``tensor_steps``), each logical tensor (global name and TP shard) counted once
    however many copies the layout holds."""
    mine = {}
    for (gname, tp_rank), w in weights.items():
        full = reference[gname]
        dim = next((d for d in range(full.dim()) if full.shape[d] != w.shape[d]), None)
        expected = full if dim is None else tp_shard(full, dim, tp, tp_rank, is_gated(config, gname))
        mine[(gname, tp_rank)] = ((w - expected).double().pow(2).sum().item(), expected.double().pow(2).sum().item(),
                                  w.numel())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = list({k: v for per_rank in gathered for k, v in per_rank.items()}.values())
    diff, norm, count = (sum(column) for column in zip(*merged))
    return {"model_rel": (diff / norm) ** 0.5, "tensor_rel": max((d / n) ** 0.5 for d, n, _ in merged if n > 0),
            "model_steps": (diff / count) ** 0.5 / lr_sum,
            "tensor_steps": max((d / c) ** 0.5 / lr_sum for d, _, c in merged)}


def what_evaluation_changed(trainer) -> tuple[dict, float]:
    """Evaluation must change no gradient, the model's or the main ones the optimizer steps (the
    distributed optimizer's live only there), and no optimizer state; with no gradient there to change
    the check would prove nothing. Returns the gradients there were, the training-state tensors before and
    after, and the names of those that changed; and the evaluation loss (the one compared with the
    reference: evaluating again would only repeat it, the state being unchanged)."""
    before = {name: t.clone() for name, t in _training_state(trainer).items()}
    gradients = sum(p.grad is not None for p in trainer.main.all())
    loss = trainer.evaluate(0)
    after = _training_state(trainer)
    changed = sorted(name for name in before.keys() & after.keys() if not torch.equal(before[name], after[name]))
    return {"gradients": gradients, "tensors before": len(before), "tensors after": len(after),
            "changed": changed}, loss


def _training_state(trainer) -> dict[str, torch.Tensor]:
    """Every gradient and optimizer-state tensor, by a name that says which."""
    params = [p for m in trainer.models for p in m.parameters()] + list(trainer.main.all())
    grads = {f"gradient {i}": p.grad for i, p in enumerate(params) if p.grad is not None}
    state = {f"optimizer state {i} {key}": v for i, s in enumerate(trainer.optimizer.state.values())
             for key, v in s.items() if torch.is_tensor(v)}
    return grads | state


def condition_number(trainer, loss: float) -> float | None:
    """sum_i |w_i dL/dw_i| / L for the step just taken (one process, fp32: the gradients are the
    parameters' own), the premise of the reduced-precision bounds (TOLERANCE)."""
    params = [p for m in trainer.models for p in m.parameters()]
    if any(p.grad is None for p in params):
        return None
    return sum((p.double() * p.grad.double()).abs().sum().item() for p in params) / abs(loss)


def count_early_reductions(trainer) -> list[tuple[int, int]]:
    """Per iteration on this rank, (gradient reductions that had started when the GradSync's ``finish``
    began, reductions): stage copies', each stage's experts', the tied embedding's. With
    --overlap-grad-reduce all of them under our executor (at their ALLREDUCE actions), the stage copies'
    under megatron-core's schedules (through its no_sync/grad_sync hooks); none without it (Megatron-LM's
    default: after the schedule)."""
    sync, seen = trainer.sync, []
    copies = len(sync.reductions) if trainer.plan.schedule is not None else \
        len(sync.stages) if hasattr(sync, "stages") else len(sync.buffers)  # distributed optimizer or not
    finish = sync.finish

    def counted():
        seen.append((len(sync.started), copies))
        finish()

    sync.finish = counted
    return seen


def reductions_before_flush(seen: list[tuple[int, int]]) -> str:
    """'all', 'none' or 'some', over every rank and iteration (count_early_reductions)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, seen)
    shares = {started / copies for per_rank in every for started, copies in per_rank}
    return "all" if shares == {1.0} else "none" if shares == {0.0} else "some"


class HookRecorder(Hooks):
    """What the hooks protocol shows the benchmark and the fault tests: each iteration begun and its
    backward finished, in order, every compute action our executor runs (timed after the flush), and
    every action it posts, with what it holds then."""

    def __init__(self):
        self.seen, self.actions, self.posted, self.kinds = [], 0, 0, set()

    def before_iteration(self, trainer, iteration):
        self.seen.append(("before", iteration))

    def after_backward(self, trainer, iteration):
        self.seen.append(("after", iteration))

    def on_action(self, action, start, end):
        self.actions += 1

    def after_action(self, action, held):
        self.posted += 1
        self.kinds.update(held())

    def observed(self) -> dict:
        """What the hooks saw, in the form ``expected`` gives (and JSON keeps)."""
        return {"iterations": [list(s) for s in self.seen], "actions": self.actions, "posted": self.posted,
                "kinds": sorted(self.kinds)}

    @staticmethod
    def expected(plan, worker: int) -> dict:
        """What they should see on ``worker`` over ITERS iterations: every iteration begun and its backward
        finished, in order; every compute action and every posted action of our executor (none under
        megatron-core's schedules); every kind of tensor the executor holds, where it posts actions."""
        actions = len(plan.schedule.compute(worker)) * ITERS if plan.schedule is not None else 0
        posted = len(plan.lowered.workers[worker]) * ITERS if plan.lowered is not None else 0
        kinds = {"receive buffers", "unsent", "in flight", "stage inputs", "kept for W"} if posted else set()
        return {"iterations": [[when, i + 1] for i in range(ITERS) for when in ("before", "after")],
                "actions": actions, "posted": posted, "kinds": sorted(kinds)}


def every_pair_fused(plan, pipeline):
    """``plan`` with each worker's adjacent forward and B-or-I of two micro-batches fused wherever the
    schedule stays valid, whether or not the pair pays; where the plan ran actions in halves, every
    forward and backward left unpaired halved (``passes.overlap.halve`` at its reference costs), so that
    one case runs pairs and halves both. ``pipeline``: the section ``plan`` was made from."""
    halves = any(a.op is Op.HALVED for w in plan.schedule.workers for a in w)
    schedule = replace(plan.schedule, workers=tuple(tuple(p for a in w for p in parts(a)) if halves else w
                                                   for w in plan.schedule.workers))
    workers = [list(w) for w in schedule.workers]
    for actions in workers:
        i = 0
        while i + 1 < len(actions):
            pair = sorted(actions[i:i + 2], key=lambda a: a.op is not Op.FORWARD)
            ops = tuple(a.op for a in pair)
            if ops in ((Op.FORWARD, Op.BACKWARD), (Op.FORWARD, Op.BACKWARD_INPUT)) and pair[0].mb != pair[1].mb:
                kept = actions[i:i + 2]
                actions[i:i + 2] = [Overlapped(*pair)]
                try:
                    validate(replace(schedule, workers=tuple(map(tuple, workers))))
                except InvalidSchedule:
                    actions[i:i + 1] = kept
            i += 1
    fused = replace(schedule, workers=tuple(map(tuple, workers)))
    if halves:
        fused = halve(fused, REFERENCE)
    validate(fused)
    lowered = lower(fused, **pipeline.reductions)
    check(lowered, PROOF_MODE)  # what make_run_plan proves of every schedule before it runs
    return replace(plan, schedule=fused, lowered=lowered)


def _overlapped(trainer) -> dict[str, int]:
    """This rank's overlapped actions, by the op of their backward part."""
    actions = trainer.plan.lowered.workers[trainer.rt.worker] if trainer.plan.lowered is not None else ()
    pairs = [a.backward.op.value for a in actions if a.op is Op.OVERLAPPED]
    return {op: pairs.count(op) for op in set(pairs)}


def _halved(trainer) -> dict[str, int]:
    """This rank's actions in halves, by the op of their whole action."""
    actions = trainer.plan.lowered.workers[trainer.rt.worker] if trainer.plan.lowered is not None else ()
    halved = [a.action.op.value for a in actions if a.op is Op.HALVED]
    return {op: halved.count(op) for op in set(halved)}


def drop_expert_gradient(trainer, prefix: str = "decoder.layers.3.mlp.experts.local_experts.0.") -> None:
    """Zero every gradient of the expert whose global names start with ``prefix``, wherever it is held."""
    for m in trainer.models:
        for p in m.parameters():
            if p.global_name.startswith(prefix):
                p.register_hook(torch.zeros_like)


def restart_counts_per_pipeline(trainer, pipelines: int = 2) -> None:
    """One process whose routers restart global_aux_loss's running token counts at each of ``pipelines``
    pipelines' first micro-batch (Chimera gives each pipeline an equal, contiguous share, forwards in order)."""
    share, seen = trainer.plan.microbatches // pipelines, [0]
    routers = [m for m in trainer.models[0].modules() if hasattr(m, "reset_global_aux_loss_tracker")]

    def restart(module, args):
        if module.training:
            if seen[0] % share == 0:
                for router in routers:
                    router.reset_global_aux_loss_tracker()
            seen[0] += 1

    trainer.models[0].register_forward_pre_hook(restart)


def weight_hash_check(trainer, plant: bool) -> dict[str, str | None]:
    """--check-weight-hash-across-dp-replicas-interval's check on the trained copies: None where they match, else
    its message; with ``plant``, again after the last rank perturbed one weight of its last chunk (then restored)."""
    def checked() -> str | None:
        try:
            trainer.check_weight_hashes(ITERS)
        except WeightHashMismatch as e:
            return str(e)
        return None

    seen = {"trained": checked()}
    if plant:
        weight = next(trainer.models[-1].parameters())
        kept = weight.detach().clone()
        if dist.get_rank() == dist.get_world_size() - 1:
            with torch.no_grad():
                weight.view(-1)[0] += 1e-3
        seen["planted"] = checked()
        with torch.no_grad():
            weight.copy_(kept)
    return seen


def run_case(flags: list[str], world: int, out: str, pair_all: bool = False, drop_expert: bool = False,
             per_pipeline: bool = False, plant_copy: bool = False):
    """Train one case; return the trainer and what was observed of it (the checks' values, which the
    tests assert on)."""
    # Megatron-LM's --data-cache-path: the first case builds the mock dataset's indices (4 million
    # samples, about a third of a small case's time), every later case of the launch loads them
    cache = os.path.join(out, f"data_cache_w{world}")
    args = parse_args(MODEL + flags + ["--data-cache-path", cache], world_size=world)
    hooks = HookRecorder()
    job = job_config(args)
    plan = make_run_plan(job.pipeline, job.parallel)
    trainer = Trainer(job, every_pair_fused(plan, job.pipeline) if pair_all else plan, forward_step, hooks)
    early = count_early_reductions(trainer)
    if drop_expert:
        drop_expert_gradient(trainer)
    if per_pipeline:
        restart_counts_per_pipeline(trainer)
    losses, kappas, differing, moe_fields, lrs, norms, zeros = [], [], [], [], [], [], []
    for i in range(ITERS):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])  # the learning rate this step takes
        stats = trainer.train_step(i)
        losses.append(stats["lm loss"])
        norms.append(stats["params norm"])
        zeros.append(stats["num zeros"])
        moe_fields.append(stats["moe"])  # the iteration line's MoE fields
        kappas.append(condition_number(trainer, losses[-1]) if world == 1 else None)
        if i == ITERS - 1 or not trainer.job.train.optimizer.overlap_param_gather:  # reading the weights
            # would finish their pending gathers, hiding a forward that reads them before they land
            differing += [f"iteration {i + 1}: {tensor}" for tensor in copies_differing(trainer)]
    run = {  # in this order: the checks on the trained state before evaluation runs
        "losses": losses, "kappa": None if None in kappas else max(kappas), "moe_fields": moe_fields,
        "lr_sum": sum(lrs), "params_norms": norms, "num_zeros": zeros,
        "copies_differing": differing, "weight_hashes": weight_hash_check(trainer, plant_copy),
        "hooks": {"saw": hooks.observed(), "expected": HookRecorder.expected(trainer.plan, trainer.rt.worker)},
        "layout_held": layout_held(trainer), "reductions_before_flush": reductions_before_flush(early),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}  # --deterministic-mode's switch
    run["evaluation"], run["eval"] = what_evaluation_changed(trainer)
    return trainer, run


def compared(run: dict, trainer, ref: dict) -> dict:
    """A multi-process case's result against its one-process reference ``ref``."""
    losses, moe = run["losses"], run["moe_fields"]
    weight = compare_weights(local_weights(trainer), ref["weights"], trainer.rt.tp, trainer.models[0].config,
                             run["lr_sum"])
    precision = trainer.job.train.precision
    return {
        "losses": losses, "reference": ref["losses"],
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
        "first_loss_rel": abs(losses[0] - ref["losses"][0]) / abs(ref["losses"][0]), "tp": trainer.rt.tp,
        "weight_rel": weight["model_rel"], "worst_tensor_rel": weight["tensor_rel"],
        "weight_steps": weight["model_steps"], "worst_tensor_steps": weight["tensor_steps"],
        "copies_differing": run["copies_differing"], "weight_hashes": run["weight_hashes"],
        "evaluation": run["evaluation"], "eval_rel": abs(run["eval"] - ref["eval"]) / abs(ref["eval"]),
        "ppl_rel": abs(validation_ppl(run["eval"]) / validation_ppl(ref["eval"]) - 1),
        "params_norm_rel": max(abs(a / b - 1) for a, b in zip(run["params_norms"], ref["params_norms"])),
        "num_zeros": run["num_zeros"], "num_zeros_reference": ref["num_zeros"],
        "precision": "fp16" if precision.fp16 else "bf16" if precision.bf16 else "fp32",
        "hooks": run["hooks"], "layout_held": run["layout_held"],
        "layout": str(trainer.plan.layout), "overlap_grad_reduce": trainer.job.train.optimizer.overlap_grad_reduce,
        "overlapped": _overlapped(trainer), "halved": _halved(trainer),
        "reductions_before_flush": run["reductions_before_flush"],
        "deterministic_algorithms": run["deterministic_algorithms"],
        "moe_fields": sorted({name for f in moe for name in f}),
        "mtp_loss": moe[-1].get("mtp_1 loss"),
        "moe_rel": (max((abs(f[k] - r[k]) / abs(r[k]) for f, r in zip(moe, ref["moe"]) for k in r), default=0.0)
                    if [set(f) for f in moe] == [set(r) for r in ref["moe"]] else 1.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="run the cases whose name contains this text (debugging)")
    options = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    read_field_docstrings_once()
    gc.freeze()  # what the imports made lives for the launch: free_groups' collections then skip it (0.37 s each)
    try:
        results = run_cases(world, options.out, options.only)
    except BaseException:
        if world == 1:  # the launches waiting for a reference stop waiting
            open(os.path.join(options.out, REFERENCES_FAILED), "w").close()
        raise
    if dist.get_rank() == 0:
        with open(os.path.join(options.out, f"cases_w{world}.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def run_cases(world: int, out: str, only: str) -> dict[str, dict]:
    """Every case of ``world`` whose name contains ``only``: on one process, write its reference and
    return what the tests check of it; on more, return it compared with its reference."""
    results = {}
    for name, (variant, flags) in cases(world).items():
        if only not in name:
            continue
        with process_state_kept():  # --deterministic-mode's torch switch and environment stay the case's
            trainer, run = run_case(VARIANTS[variant] + flags, world, out, pair_all=name in PAIRS_FORCED,
                                    drop_expert=name == DROPPED_EXPERT, per_pipeline=variant == PER_PIPELINE,
                                    plant_copy=name == PLANTED_COPY)
        if world == 1:
            save_reference(trainer, run, os.path.join(out, f"ref_{variant}.pt"))
            results[name] = {"losses": run["losses"], "eval": run["eval"], "kappa": run["kappa"]}
        else:
            results[name] = compared(run, trainer, load_reference(out, variant))
        trainer.close()
        del trainer  # then free it: see free_groups
        free_groups()
        if world > 1 and dist.get_rank() == 0:
            r = results[name]
            print(f"{name}: loss_rel {r['loss_rel']:.2e} weight_rel {r['weight_rel']:.2e} ({r['weight_steps']:.2e} "
                  f"steps) worst tensor {r['worst_tensor_rel']:.2e} ({r['worst_tensor_steps']:.2e} steps)", flush=True)
    return results


def free_groups() -> None:
    """Free a closed trainer's process groups now, once nothing refers to the trainer. Its modules refer to
    their groups from reference cycles, and each gloo group keeps threads that wake every 10 ms until the group
    is freed: without a collection they outlive the case, and over a launch's cases thousands of threads
    wake (most of the harness's system time) until Python's rare full collection. main froze the imports'
    objects, so a collection reads only what the cases made."""
    gc.collect()


def save_reference(trainer, run: dict, path: str) -> None:
    """What a layout's case is compared with, written whole: a launch running beside this one waits for ``path``
    and reads it as soon as it exists."""
    weights = {k[0]: v for k, v in local_weights(trainer).items()}
    torch.save({"losses": run["losses"], "eval": run["eval"], "weights": weights, "moe": run["moe_fields"],
                "params_norms": run["params_norms"], "num_zeros": run["num_zeros"]}, path + ".partial")
    os.replace(path + ".partial", path)


def load_reference(out: str, variant: str, timeout: float = 600) -> dict:
    """``variant``'s one-process reference, once the one-process launch has written it (it may be running
    beside this launch); raises if that launch failed, or wrote nothing within ``timeout`` seconds."""
    path, deadline = os.path.join(out, f"ref_{variant}.pt"), time.monotonic() + timeout
    while not os.path.exists(path):
        if os.path.exists(os.path.join(out, REFERENCES_FAILED)):
            raise RuntimeError(f"the one-process launch failed before writing {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no one-process reference {path} after {timeout} s")
        time.sleep(0.2)
    return torch.load(path, weights_only=True)


if __name__ == "__main__":
    main()
