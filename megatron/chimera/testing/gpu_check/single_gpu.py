"""The checks one GPU allows. Two ranks share it through host-staged gloo (--p2p-host-staging), so our
executor runs with every action it runs on a cluster (four ranks for plan mode, whose expert parallelism
needs DP=2); --cpu-smoke runs the CPU half of each check that has one (gloo, no staging).

The executor launch (``executor_run``) is shared: Chimera D=2, local layers, with 1 MiB activations on a
GPU, its syncs noted, memory sampled after every action and the action clock on; the apex check reads
the fusions it kept off. The two plan-mode launches share their one-process reference with the NCCL MoE
cases (launching.moe_model)."""
from __future__ import annotations

import os
import re
import sys
import tempfile

from megatron.chimera.model.chunk import delays_weight_gradients
from megatron.chimera.testing.equivalence import MODEL, TOLERANCE, VARIANTS

from .launching import (
    COMMON,
    DISTOPT,
    FP32_RTOL,
    ITERS,
    LOCAL,
    MIB,
    OVERLAPPED,
    PLAN_MODE,
    TINY,
    Machine,
    child_env,
    chimera,
    compare,
    launch,
    moe_model,
    resized,
    result,
    train,
)

# 1 MiB fp32 activations (sequence 1024 x hidden 256): activations dominate what an action allocates
MID = resized(256, 4, 1024)
# what megatron-core's local layers take from apex's kernels (model/chunk.py's fusions_off)
APEX_FUSIONS = ("gradient_accumulation_fusion", "masked_softmax_fusion", "persist_layer_norm")


def executor_run(m: Machine):
    model = TINY if m.smoke else MID
    return train(m, model + LOCAL + chimera(2) + m.staging, 2, sync="off" if m.smoke else "warn", actions=True)


def check_executor_matches(m: Machine) -> dict:
    """Our executor, two processes (sharing the GPU), against one process of the same model."""
    run = executor_run(m)
    model = TINY if m.smoke else MID
    return compare(run, train(m, model + LOCAL, 1), FP32_RTOL)


def check_split_backward_matches(m: Machine) -> dict:
    """Chimera D=2 --split-backward equals Chimera D=2 unsplit: splitting reorders work, never results."""
    base = TINY + LOCAL + chimera(2) + m.staging
    return compare(train(m, base + ["--split-backward"], 2), train(m, base, 2), FP32_RTOL)


def check_bf16_distributed_optimizer(m: Machine) -> dict:
    """megatron/chimera/testing/equivalence.py's bf16 Chimera D=2 case, distributed optimizer added, against
    its one-process bf16 reference with the distributed optimizer; its bound."""
    flags = MODEL + VARIANTS["bf16"] + ["--micro-batch-size", "1"] + COMMON + DISTOPT
    found = compare(train(m, flags + chimera(2) + m.staging, 2), train(m, flags, 1), TOLERANCE["bf16"][0])
    return {**found, "bound_source": "megatron/chimera/testing/equivalence.py TOLERANCE['bf16'][0] = ITERS x 2^-8"}


def check_plan_mode_matches(m: Machine) -> dict:
    """--overlap-moe-expert-parallel-comm: our executor runs megatron-core's schedule plans, each action in
    two halves, each all-to-all on the communication stream, ordered by CUDA events on a GPU (on the CPU,
    cpu_compat's one stream). Chimera D=2 with DP=2 and EP=2, four ranks sharing the GPU, against one
    process."""
    return compare(train(m, moe_model(m) + chimera(2) + PLAN_MODE + m.staging, 4), train(m, moe_model(m), 1),
                   FP32_RTOL)


def check_plan_mode_overlapped_gather(m: Machine) -> dict:
    """The same with the distributed optimizer, --overlap-grad-reduce and --overlap-param-gather: each
    step's weight all-gathers are overlapped with the next iteration, and the forwards must wait for them,
    which megatron-core does in a forward pre-hook of the whole model that plan mode never calls (stale
    weights show as losses drifting from iteration 2)."""
    flags = moe_model(m) + chimera(2) + PLAN_MODE + OVERLAPPED + m.staging
    return compare(train(m, flags, 4), train(m, moe_model(m), 1), FP32_RTOL)


def check_apex_kernels(m: Machine) -> dict:
    """NVIDIA's apex with its kernels: INCOMPLETE where it does not import (megatron-core's local layers
    then run without its fusions, and every run here with them, unchecked); where it does, the executor
    run kept none of its fusions off."""
    if m.need(1):
        return result("skipped", m.need(1))
    if m.apex:
        return result("incomplete", f"apex unusable ({m.apex}): gradient-accumulation fusion, the fused softmax "
                      "and the persistent layer norm unchecked")
    run = executor_run(m)
    if run.failure():
        return result("fail", f"run failed: {run.failure()}", command=run.command)
    off = [f for f in APEX_FUSIONS if any(f in line for line in run.fusions_kept_off)]
    if off:
        return result("fail", f"apex imports, yet the run kept {', '.join(off)} off",
                      fusions_kept_off=run.fusions_kept_off, command=run.command)
    return result("pass", f"apex's kernels in use: the executor run kept none of {', '.join(APEX_FUSIONS)} off",
                  fusions_kept_off=run.fusions_kept_off, command=run.command)


def check_te_split_backward(m: Machine) -> dict:
    """DualPipeV (a split backward in its IR) with Transformer Engine layers: trains equal to one TE
    process where TE has its weight-gradient split for these flags (chunk.delayed_wgrad_te: 2.3 with
    gradient-accumulation fusion). Where this TE has no split for these flags the run must be refused before
    anything starts, in one line naming --transformer-impl, with nothing written: a refusal checks that rule,
    never the split backward, so it is INCOMPLETE (a refusal that misbehaves is FAIL)."""
    if m.need(1):
        return result("skipped", m.need(1))
    if not m.te:
        return result("skipped", "Transformer Engine not installed")
    te = ["--transformer-impl", "transformer_engine"]
    flags = TINY + te + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"] + m.staging
    if delays_weight_gradients(overlap_grad_reduce=False, gradient_accumulation_fusion=True):
        return compare(train(m, flags, 2), train(m, TINY + te, 1), FP32_RTOL)
    return _refused(m, flags)


def _refused(m: Machine, flags: list[str]) -> dict:
    out = tempfile.mkdtemp(dir=m.workdir)
    cmd = [sys.executable, "pretrain_gpt.py", *flags, "--save", os.path.join(out, "ckpt"), "--save-interval", "1",
           "--tensorboard-dir", os.path.join(out, "tb")]
    rc, stdout, stderr = launch(cmd, child_env(m))
    errors = [line for line in stderr.splitlines() if re.search(r"error:", line, re.IGNORECASE)]
    problems = [p for p, bad in (
        (f"exit code {rc}", rc == 0 or rc is None),
        (f"{len(errors)} error lines, expected one naming --transformer-impl",
         len(errors) != 1 or "--transformer-impl" not in errors[0]),
        ("it trained", "lm loss:" in stdout),
        (f"it wrote {os.listdir(out)}", bool(os.listdir(out)))) if bad]
    details = dict(command=" ".join(cmd), exit_code=rc, error_lines=errors)
    if problems:
        return result("fail", "; ".join(problems), output_tail=(stdout + stderr)[-3000:], **details)
    return result("incomplete", f"this Transformer Engine has no split backward here, refused as it must be: "
                  f"{errors[0]}", **details)


def check_no_sync(m: Machine, nccl_runs: dict) -> dict:
    """No host synchronisation inside forward_backward: a one-process run (megatron-core's own schedule)
    and every NCCL run in sync-debug mode "error"; the host-staged executor run in mode "warn", where the
    staging copies (synchronous by design: gloo reads host memory) are listed and every other sync fails."""
    if m.need(1):
        return result("skipped", m.need(1))
    runs = {"one process": train(m, TINY, 1, sync="error"), "executor, host-staged": executor_run(m), **nccl_runs}
    found = {name: run.failure() or "clean" for name, run in runs.items()}
    for name, run in runs.items():
        unstaged = [f"rank {r['rank']}: {where}" for r in run.reports for where in r["syncs"]
                    if not where.startswith("staging:")]
        if unstaged and found[name] == "clean":
            found[name] = f"{len(unstaged)} synchronising call sites, the first {unstaged[0]}"
    details = dict(runs=found, commands={name: run.command for name, run in runs.items()},
                   syncs={name: {f"rank {r['rank']}: {w}": n for r in run.reports for w, n in r["syncs"].items()}
                          for name, run in runs.items()},
                   explicit_waits={name: {f"rank {r['rank']}: {w}": n for r in run.reports
                                          for w, n in r["explicit_waits"].items()} for name, run in runs.items()})
    bad = [(name, why) for name, why in found.items() if why != "clean"]
    if bad:
        return result("fail", f"{bad[0][0]}: {bad[0][1]}", **details)
    return result("pass", f"no host synchronisation inside forward_backward in {len(runs)} runs (host staging's "
                  "copies listed under syncs)", **details)


def check_memory_per_action(m: Machine) -> dict:
    """Memory after every action of the executor run. On a GPU (memory_allocated): no growth after
    iteration 2; nothing held across the flush; and within an iteration, memory above the iteration's
    start stays within what the micro-batches in flight hold (each one's forward's measured growth, until
    its backward), so anything kept until the flush shows. The CPU half samples the bytes the executor
    itself holds: no growth after iteration 2, and none held at the iteration's end beyond its start."""
    run = executor_run(m)
    why = run.failure() or (None if len(run.reports) == 2 else f"{len(run.reports)} rank reports of 2")
    if why:
        return result("fail", f"run failed: {why}", command=run.command)
    problems, summary = [], {}
    for report in run.reports:
        found = _memory_problems(report, cuda=not m.smoke)
        summary[report["rank"]] = found.pop("summary")
        problems += [f"rank {report['rank']}: {p}" for p in found["problems"]]
    details = dict(per_rank_mib=summary, command=run.command,
                   sampled="memory_allocated" if not m.smoke else "bytes the executor holds (CPU half)")
    if problems:
        return result("fail", problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                      problems=problems, **details)
    return result("pass", f"memory per action flat over iterations 2-{ITERS} and released by the flush on every rank"
                  + ("" if m.smoke else ", within the micro-batches in flight"), **details)


def _memory_problems(report: dict, cuda: bool) -> dict:
    by_iteration = {}
    for iteration, action, now, _ in report["actions"]:
        by_iteration.setdefault(iteration, []).append((action, now))
    first = by_iteration.get(2, [])
    slack = lambda level: max(MIB, 0.005 * level)  # noqa: E731
    problems = []
    peak2 = max((now for _, now in first), default=0)
    for iteration in range(3, ITERS + 1):
        peak = max((now for _, now in by_iteration.get(iteration, [])), default=0)
        if peak - peak2 > slack(peak2):
            problems.append(f"iteration {iteration}'s peak is {(peak - peak2) / MIB:.2f} MiB above iteration 2's")
    marks = {point: now for point, _, now in report["memory"]}
    excess = []
    for iteration in range(2, ITERS + 1):
        start, end = marks.get(f"before iteration {iteration}"), marks.get(f"after backward {iteration}")
        if cuda and start is not None and end is not None and end - start > slack(start):
            problems.append(f"{(end - start) / MIB:.2f} MiB more after iteration {iteration}'s flush than before it")
        if cuda and start is not None:
            excess.append(_beyond_in_flight(by_iteration.get(iteration, []), start))
    if excess and max(e for e, _ in excess) > 0:
        worst = max(excess)
        problems.append(f"{worst[0] / MIB:.2f} MiB beyond the micro-batches in flight after {worst[1]}")
    summary = {"iteration 2 peak": round(peak2 / MIB, 3),
               "series": {it: [[a, round(n / MIB, 3)] for a, n in rows] for it, rows in by_iteration.items()
                          if it in (1, 2, ITERS)}}
    return {"problems": problems, "summary": summary}


_COMPUTE = re.compile(r"^([FBIW])(\d+)p(\d+)s(\d+)$")


def _beyond_in_flight(rows: list, start: int) -> tuple[float, str]:
    """The most memory above ``start`` beyond what the micro-batches in flight explain, less a slack of
    2 MiB and 10% (the allocator's rounding, messages, workspaces), and the action after which it was seen.
    A micro-batch is in flight from its forward (its measured growth) until its backward (B, or W after a
    split one)."""
    grown, live, previous = {}, set(), start
    split = any(a.startswith("W") for a, _ in rows)
    worst = (float("-inf"), "")
    for action, now in rows:
        match = _COMPUTE.match(action)
        if match:
            op, key = match.group(1), match.group(2, 3, 4)
            if op == "F":
                grown[key] = max(now - previous, 0)
                live.add(key)
            elif op == ("W" if split else "B"):
                live.discard(key)
        predicted = sum(grown[k] for k in live)
        beyond = now - start - predicted - (2 * MIB + 0.1 * predicted)
        worst = max(worst, (beyond, action))
        previous = now
    return worst


def check_action_clock(m: Machine) -> dict:
    """The executor's action clock (CUDA events on a GPU, read once after the flush; perf_counter on the
    CPU) gives sane times: every action ends after it starts, actions on one rank do not overlap (one
    stream), and their sum fits in the iteration's wall time."""
    run = executor_run(m)
    why = run.failure()
    if why:
        return result("fail", f"run failed: {why}", command=run.command)
    problems, busy = [], {}
    for report in run.reports:
        walls = dict((it, s) for it, s in report["iteration_seconds"])
        for iteration in sorted(walls):
            stamps = [(a, s, e) for it, a, s, e in report["clock"] if it == iteration]
            found = _clock_problems(stamps, walls[iteration])
            problems += [f"rank {report['rank']} iteration {iteration}: {p}" for p in found]
            if stamps:
                busy[f"rank {report['rank']} iteration {iteration}"] = round(
                    sum(e - s for _, s, e in stamps) / walls[iteration], 3)
    if not busy:
        problems.append("no action times recorded")
    details = dict(compute_fraction_of_wall=busy, clock="CUDA events" if not m.smoke else "perf_counter (CPU half)",
                   command=run.command)
    if problems:
        return result("fail", problems[0], problems=problems, **details)
    return result("pass", f"{sum(len(r['clock']) for r in run.reports)} action times sane on every rank", **details)


def _clock_problems(stamps: list, wall: float) -> list[str]:
    problems = [f"{a} ends before it starts ({(e - s) * 1e3:.3f} ms)" for a, s, e in stamps if e < s]
    problems += [f"{b[0]} starts {(a[2] - b[1]) * 1e3:.3f} ms before {a[0]} ends" for a, b in zip(stamps, stamps[1:])
                 if b[1] < a[2] - 1e-4]
    total = sum(e - s for _, s, e in stamps)
    if total > wall * 1.05 + 1e-3:
        problems.append(f"actions sum to {total * 1e3:.1f} ms, more than the iteration's {wall * 1e3:.1f} ms")
    return problems
