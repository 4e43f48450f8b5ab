"""The checks that need two or more GPUs: our executor on NCCL, each case against one fp32 process.

NCCL launches run with NCCL_DEBUG=INFO (each rank counts the communicators NCCL reports created, before
iteration 1 and at the end), a 1 MiB NCCL_BUFFSIZE under 4 MiB activations (BIG; the MoE cases a 128 KiB
one under their 512 KiB to 1 MiB messages), so a send completes only once its receive is posted and a
rendezvous-order deadlock would show, CUDA_DEVICE_MAX_CONNECTIONS=1 (one case without it),
--distributed-timeout-minutes 2 and a launch timeout, so a hang fails its check rather than the script.
With --nodes every case spreads its ranks evenly over the nodes. --cpu-smoke runs each case's CPU half:
the tiny model over gloo under --emulate-nccl (Chimera D=2 with DP=2 among them), where a collective or
p2p on a group the warm-up did not reach fails at once.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

from megatron.core.transformer.moe import fused_a2a

from megatron.chimera.model.chunk import delayed_wgrad_te, delays_weight_gradients, transformer_engine_version
from megatron.chimera.testing.equivalence import MODEL, TOLERANCE, VARIANTS

from .launching import (
    BIG,
    DISTOPT,
    EP2,
    FP32_RTOL,
    ITERS,
    LOCAL,
    MIB,
    MOE_BUFFSIZE,
    OVERLAPPED,
    PLAN_MODE,
    TINY,
    Machine,
    chimera,
    compare,
    compare_losses,
    moe_model,
    result,
    train,
    with_flag,
)

NCCL_ENV = {"NCCL_DEBUG": "INFO", "NCCL_BUFFSIZE": str(MIB)}
TE = ["--transformer-impl", "transformer_engine"]
CP2 = ["--context-parallel-size", "2"]
# The timed model: 1 MiB of bf16 activation per micro-batch and enough micro-batches to fill the pipeline
TIMED = ["--mock-data", "--vocab-size", "32000", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads",
         "16", "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
         "--global-batch-size", "32", "--train-iters", "12", "--lr", "1e-4", "--bf16", "--eval-iters", "0",
         "--log-interval", "1", "--distributed-timeout-minutes", "2"]
# equivalence.py's bf16 model (its bound: TOLERANCE["bf16"])
BF16 = MODEL + VARIANTS["bf16"] + ["--micro-batch-size", "1", "--log-interval", "1"]
FLEX = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]


@dataclass(frozen=True)
class Case:
    name: str
    ranks: int
    flags: list[str]
    reference: list[str]  # one process, the same layers
    bound: float = FP32_RTOL
    env: dict = field(default_factory=dict)
    not_on_cpu: str | None = None  # why --cpu-smoke does not run its CPU half (None: it does)
    # what the case checks that a machine may lack (INCOMPLETE there): "transformer_engine", "te_split"
    # (its weight-gradient split at these flags), "apex" (gradient-accumulation fusion's kernel)
    needs: tuple[str, ...] = ()


def cases(m: Machine) -> list[Case]:
    """Chimera D=2 and D=4, with a second data-parallel replica where the GPUs allow, each variant; then
    the cases of one configuration each."""
    model = TINY if m.smoke else BIG
    found = []
    for d in (2, 4):
        dp = 2 if not m.smoke and m.all_gpus >= 2 * d else 1
        run, tag = model + chimera(d), f"nccl chimera D={d}" + (" DP=2" if dp > 1 else "")
        only_plain = "cpu-smoke: at D=4 only the plain case runs (2 cores)" if d == 4 else None
        found += [Case(tag, d * dp, run, model),
                  Case(f"{tag} split-backward", d * dp, run + LOCAL + ["--split-backward"], model + LOCAL,
                       not_on_cpu=only_plain),
                  Case(f"{tag} distributed-optimizer", d * dp, run + DISTOPT, model, not_on_cpu=only_plain),
                  Case(f"nccl chimera D={d} TP=2 sequence-parallel", 2 * d,
                       run + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], model,
                       not_on_cpu=only_plain)]
    return found + _single_cases(m, model)


def _single_cases(m: Machine, model: list[str]) -> list[Case]:
    # DP=2 on the CPU too: --cpu-smoke's data-parallel case
    dp = 2 if m.smoke or m.all_gpus >= 4 else 1
    moe, moe_env = moe_model(m), {"NCCL_BUFFSIZE": str(MOE_BUFFSIZE)}
    te_bf16 = BF16 + TE
    return [
        Case("nccl chimera D=2" + (" DP=2" if dp > 1 else "") + " distributed-optimizer overlapped reduce and gather",
             2 * dp, model + chimera(2) + OVERLAPPED, model),
        Case("nccl chimera D=2 bf16 distributed-optimizer", 2, BF16 + DISTOPT + chimera(2), BF16 + DISTOPT,
             TOLERANCE["bf16"][0]),
        Case("nccl chimera D=2 transformer-engine", 2, model + chimera(2) + TE, model + TE,
             not_on_cpu="cpu-smoke: Transformer Engine's layers need a GPU", needs=("transformer_engine",)),
        Case("nccl chimera D=2 transformer-engine bf16 split-backward gradient-accumulation-fusion", 2,
             te_bf16 + chimera(2) + ["--split-backward"], te_bf16, TOLERANCE["bf16"][0],
             not_on_cpu="cpu-smoke: Transformer Engine's layers need a GPU",
             needs=("transformer_engine", "te_split", "apex")),
        # context parallelism in Transformer Engine's attention, its default ring (p2p) over the CP group, in bf16
        # (TE's fp32 attention is its unfused one, which has no CP); the CPU's gathered attention runs in the
        # equivalence harness (testing/equivalence.py)
        Case("nccl chimera D=2 CP=2 bf16 transformer-engine", 4, model + BF16 + chimera(2) + CP2 + TE,
             model + BF16 + TE, TOLERANCE["bf16"][0], not_on_cpu="cpu-smoke: Transformer Engine's layers need a GPU",
             needs=("transformer_engine",)),
        Case("nccl chimera D=2 MoE EP=2 alltoall", 4, moe + chimera(2) + EP2, moe, env=moe_env),
        # megatron-core's flex dispatcher inside each MoE layer, DeepEP's kernels (bf16: what they dispatch)
        Case("nccl chimera D=2 MoE EP=2 flex dispatcher DeepEP bf16", 4, moe + VARIANTS["bf16"] + chimera(2) + EP2
             + FLEX, moe + VARIANTS["bf16"], TOLERANCE["bf16"][0], env=moe_env,
             not_on_cpu="cpu-smoke: the flex dispatcher's kernels need a GPU", needs=("deep_ep",)),
        Case("nccl chimera D=2 DP=2 MoE EP=2 plan mode overlapped reduce and gather", 4,
             moe + chimera(2) + PLAN_MODE + OVERLAPPED, moe, env=moe_env,
             not_on_cpu="cpu-smoke: its CPU half is plan-mode-overlapped-gather-matches-one-process's run"),
        Case("nccl chimera D=2 CUDA_DEVICE_MAX_CONNECTIONS unset", 2, model + chimera(2), model,
             env={"CUDA_DEVICE_MAX_CONNECTIONS": None}, not_on_cpu="cpu-smoke: a CUDA setting")]


def _launch(m: Machine, case: Case, flags: list[str] | None = None, iters: int | None = None):
    """The case's run: on NCCL in sync-debug mode "error" (the no-sync check reads it); its CPU half under
    --emulate-nccl."""
    flags = flags or case.flags
    if m.smoke:
        return train(m, flags + ["--emulate-nccl"], case.ranks, iters=iters)
    return train(m, flags, case.ranks, sync="error", env={**NCCL_ENV, **case.env}, iters=iters, spread=True)


def _unavailable(m: Machine, case: Case) -> str | None:
    return case.not_on_cpu if m.smoke else m.need(case.ranks, spread=True)


def _uncheckable(m: Machine, case: Case) -> str | None:
    """Why a case this machine could run checks nothing here (INCOMPLETE), or None."""
    if "transformer_engine" in case.needs and not m.te:
        return "Transformer Engine not installed: its layers on NCCL unchecked"
    if "deep_ep" in case.needs and not fused_a2a.HAVE_DEEP_EP:
        return "DeepEP (deep_ep) not installed: megatron-core's flex dispatcher unchecked"
    # the release the run's own rule asks (config/schedule_rules.py), by the flags: gradient-accumulation fusion
    if "te_split" in case.needs and not delays_weight_gradients(overlap_grad_reduce=False,
                                                                gradient_accumulation_fusion=True):
        return (f"Transformer Engine {transformer_engine_version()} has no weight-gradient split under these flags "
                f"(needs {delayed_wgrad_te(False, True)}): its split backward on NCCL unchecked")
    return None


def check_case(m: Machine, case: Case) -> dict:
    why = _unavailable(m, case)
    if why:
        return result("skipped", why)
    if _uncheckable(m, case):
        return result("incomplete", _uncheckable(m, case))
    found = compare(_launch(m, case), train(m, case.reference, 1), case.bound)
    if found["status"] == "pass" and "apex" in case.needs and m.apex:
        return {**found, "status": "incomplete",
                "reason": f"{found['reason']}, but gradient-accumulation fusion was off: apex unusable ({m.apex})"}
    return found


def nccl_runs(m: Machine) -> dict:
    """The NCCL runs this machine allows (launched once; the no-sync check reads them)."""
    if m.smoke:
        return {}
    return {c.name: _launch(m, c) for c in cases(m) if not m.need(c.ranks, spread=True) and not _uncheckable(m, c)}


def check_eval_save_resume(m: Machine) -> dict:
    """Chimera D=2 trains 3 iterations with an evaluation, saves and exits (--exit-interval); a second
    launch loads it and trains 3 more, evaluating again: the 6 training and 2 validation losses equal one
    process's uninterrupted run."""
    model = TINY if m.smoke else BIG
    case = Case("eval save resume", 2, model + chimera(2), model)
    if _unavailable(m, case):
        return result("skipped", _unavailable(m, case))
    folder = os.path.join(m.workdir, "resume")
    evaluated = with_flag(case.flags, "--eval-iters", "2") + ["--eval-interval", "3"]
    first = _launch(m, case, evaluated + ["--save", folder, "--save-interval", "3", "--exit-interval", "3"], iters=3)
    second = _launch(m, case, evaluated + ["--save", folder, "--save-interval", "3", "--load", folder], iters=ITERS - 3)
    reference = train(m, with_flag(case.reference, "--eval-iters", "2") + ["--eval-interval", "3"], 1)
    for label, run in (("first launch", first), ("resumed launch", second), ("reference", reference)):
        if run.failure():
            return result("fail", f"{label} failed: {run.failure()}", command=run.command, output_tail=run.tail)
    losses = compare_losses(first.losses + second.losses, reference.losses, FP32_RTOL,
                            commands=[first.command, second.command, reference.command])
    validation = compare_losses(first.validation + second.validation, reference.validation, FP32_RTOL)
    if losses["status"] != "pass" or validation["status"] != "pass" or len(reference.validation) != 2:
        bad = losses if losses["status"] != "pass" else validation
        return result("fail", f"training or validation losses: {bad['reason']}", training=losses,
                      validation=validation)
    return result("pass", f"6 training and 2 validation losses across a save and resume: {losses['reason']}",
                  training=losses, validation=validation)


def check_no_late_communicators(m: Machine) -> dict:
    """No communicator created after the warm-up: on NCCL, the "Init COMPLETE" lines of NCCL_DEBUG=INFO
    counted per rank before iteration 1 and at the end; under --cpu-smoke, the emulated runs, where the
    warm-up's guard fails any collective or p2p on a group it did not reach."""
    runs = nccl_runs(m) if not m.smoke else {c.name: _launch(m, c) for c in cases(m) if not c.not_on_cpu}
    if not runs:
        return result("skipped", m.need(2))
    late, counted = [], {}
    for name, run in runs.items():
        if run.failure():
            late.append(f"{name}: run failed: {run.failure()}")
            continue
        for r in run.reports:
            inits = r["nccl_inits"]
            counted[f"{name} rank {r['rank']}"] = inits
            if not m.smoke and inits.get("end", 0) != inits.get("before iteration 1", 0):
                late.append(f"{name} rank {r['rank']}: {inits['end'] - inits['before iteration 1']} communicators "
                            "created after the warm-up")
    details = dict(nccl_inits=counted, runs=list(runs))
    if late:
        return result("fail", late[0], problems=late, **details)
    how = "NCCL's Init COMPLETE lines unchanged after iteration 1 began" if not m.smoke else \
        "emulated NCCL: the warm-up guard raised in none"
    return result("pass", f"{len(runs)} runs: {how}", **details)


def check_across_nodes(m: Machine) -> dict:
    """With --nodes N, every NCCL run that ran had its ranks on N hosts (each rank's report names its own)."""
    if m.smoke or m.nodes == 1:
        return result("skipped", ("cpu-smoke: " if m.smoke else "") + "one node; sbatch "
                      "recipes/slurm/gpu_check_two_nodes.sbatch spreads the NCCL cases over two")
    ran = {name: run for name, run in nccl_runs(m).items() if not run.failure()}
    if not ran:
        return result("skipped", m.need(2, spread=True) or "no NCCL run succeeded (their checks say why)")
    hosts = {name: sorted({r["host"] for r in run.reports}) for name, run in ran.items()}
    narrow = [f"{name}: its ranks ran on {len(h)} hosts, not {m.nodes}" for name, h in hosts.items()
              if len(h) != m.nodes]
    if narrow:
        return result("fail", narrow[0], problems=narrow, hosts=hosts)
    return result("pass", f"{len(ran)} NCCL runs, each with ranks on {m.nodes} hosts", hosts=hosts)


def check_timed_against_1f1b(m: Machine) -> dict:
    """Chimera D=2 against megatron-core's 1F1B on the same model and GPUs, the baseline with
    --overlap-grad-reduce (as Megatron-LM's recipes run it): median iteration time from iteration 3 on,
    reported as a ratio. A time is reported, never asserted."""
    if m.smoke:
        return result("skipped", "cpu-smoke: a time needs GPUs")
    if m.need(2):
        return result("skipped", m.need(2))
    ranks = 4 if m.gpus >= 4 else 2
    base = TIMED + ["--pipeline-model-parallel-size", "2"]
    runs = {"chimera": train(m, base + ["--pipeline-schedule", "chimera"], ranks),
            "megatron-1f1b": train(m, base + ["--pipeline-schedule", "megatron-1f1b", "--overlap-grad-reduce"], ranks)}
    medians = {}
    for name, run in runs.items():
        if run.failure():
            return result("fail", f"{name} failed: {run.failure()}", command=run.command)
        medians[name] = statistics.median(run.times_ms[2:])
    ratio = medians["megatron-1f1b"] / medians["chimera"]
    return result("measured", f"megatron-core 1F1B / Chimera iteration time = {ratio:.3f} ({ranks} GPUs)",
                  median_ms=medians, ratio=ratio, commands={n: r.command for n, r in runs.items()})
