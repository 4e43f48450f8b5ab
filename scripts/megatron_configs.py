"""Megatron-LM's own functional-test configurations, run as a user moving to Chimera would run them.

Megatron-LM keeps a ``model_config.yaml`` per functional test (``tests/functional_tests/test_cases/``):
the flags its CI trains with. They are the best sample of what Megatron-LM users type. This reads the
GPT, MoE and Mixtral training cases of a Megatron-LM checkout and prepares each as a user would:

- the data and tokenizer stood in (``--mock-data``, the null tokenizer), paths under a temporary folder
  (``--save`` and ``--load`` one folder, empty at the start: Megatron-LM's first launch);
- the sizes scaled down (4 layers, hidden 16 per head, 64 tokens, 3 iterations, small experts);
- ``--pipeline-model-parallel-size 2 --pipeline-schedule chimera`` added (``--depth``: another D), the other
  parallel sizes kept
  (the data-parallel size is the smallest the expert layout allows);
- Transformer Engine swapped for the local layers, the flex dispatcher (GPU kernels) for the alltoall one, and
  the flags ``flag_classes`` calls GPU-only taken out, the flex dispatcher's with it.

Then each goes through ``pretrain_gpt.py``'s parser (in this process, nothing started), and every flag
that stops it is found by taking the refused one out and parsing again. ``--train K`` trains K of the
configurations that pass, chosen to cover the most distinct flags, 3 iterations each, in one launch per
world size. Prints a table; ``--json`` writes every configuration's result.

    git clone --depth 1 https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    python scripts/megatron_configs.py /tmp/Megatron-LM --json configs.json --train 12
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import io
import json
import logging
import math
import os
import re
import sys
import tempfile

import yaml

from megatron.chimera import parse_args
from megatron.chimera.config.flag_classes import FLEX_DISPATCHER, REFUSED
from megatron.chimera.config.flag_table import megatron_parser

# Megatron-LM's flags that take several values (nargs + or *), e.g. --hierarchical-context-parallel-sizes "2 2"
SEVERAL = {o for a in megatron_parser()._actions if a.nargs in ("+", "*") for o in a.option_strings}

FAMILIES = ("gpt", "moe", "mixtral")
# paths and data: the stand-ins replace them
DROPPED = {"--data-path", "--data-cache-path", "--tokenizer-model", "--vocab-file", "--merge-file",
           "--tokenizer-type", "--per-split-data-args-path", "--data-args-path", "--train-data-path",
           "--valid-data-path", "--test-data-path", "--pipeline-model-parallel-layout",
           "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--train-samples",
           "--lr-decay-samples", "--lr-warmup-samples", "--lr-wsd-decay-samples", "--exit-interval",
           "--exit-duration-in-mins", "--pipeline-model-parallel-size", "--output-path", "--pretrained-checkpoint",
           "--ckpt-step", "--mock-data", "--vocab-size", "--use-mcore-models",
           # the interleaved schedule's: Chimera replaces it
           "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
           "--microbatch-group-size-per-virtual-pipeline-stage"}
GPU_ONLY = frozenset().union(FLEX_DISPATCHER, *(flags for reason, flags in REFUSED.items()
                                                 if reason.startswith("GPU-only")))
# sizes scaled down, by flag: a value, or a function of the parallel sizes
SCALED = {
    "--num-experts": lambda p: 8 if 8 % p["ep"] == 0 else p["ep"],
    "--moe-ffn-hidden-size": 32, "--moe-shared-expert-intermediate-size": 32,
    "--q-lora-rank": 32, "--kv-lora-rank": 16, "--qk-head-dim": 16, "--qk-pos-emb-head-dim": 8, "--v-head-dim": 16,
    "--kv-channels": 16, "--seq-length": 64, "--max-position-embeddings": 64, "--eval-iters": 1,
    "--eval-interval": 2, "--save-interval": 2, "--log-interval": 1, "--lr-decay-iters": 3, "--lr-warmup-iters": 1,
    "--window-size": "16,0", "--micro-batch-size": 1, "--moe-router-num-groups": 2, "--moe-router-group-topk": 1,
    "--moe-router-topk": lambda p: min(int(p["value"]), 2),
    "--seed": lambda p: p["value"] if "$" not in p["value"] else 1234,
    "--moe-layer-freq": lambda p: _scaled_pattern(p["value"]),
}
LAYERS = 4


def _scaled_steps(schedule: str, dp: int) -> str:
    """A step batch-size schedule of K steps, scaled: batches of 4, 8, ... 4K micro-batches per data-parallel
    rank, each step reached after one iteration of the one before (thresholds in tokens, of --seq-length)."""
    tokens = SCALED["--seq-length"]
    sizes = [4 * dp * (k + 1) for k in range(len(schedule.split()))]
    return " ".join(f"{sum(sizes[:k]) * tokens}:{size}" for k, size in enumerate(sizes))


def _scaled_pattern(value: str) -> str:
    """A per-layer MoE pattern (``([0]*3+[1]*5)``) for LAYERS layers: the same share of dense layers first."""
    if not value.startswith("("):
        return value
    pattern = eval(value, {"__builtins__": {}})  # Megatron-LM's own syntax for it is a Python expression
    dense = round(pattern.count(0) * LAYERS / len(pattern))
    return f"([0]*{dense}+[1]*{LAYERS - dense})"


def training_configs(checkout: str) -> dict[str, dict]:
    """name -> MODEL_ARGS of every GPT/MoE/Mixtral case that trains (sets --train-iters or --train-samples)."""
    found = {}
    root = os.path.join(checkout, "tests", "functional_tests", "test_cases")
    for family in FAMILIES:
        for path in sorted(glob.glob(os.path.join(root, family, "*", "model_config.yaml"))):
            with open(path) as f:
                model_args = (yaml.safe_load(f) or {}).get("MODEL_ARGS") or {}
            if "--train-iters" in model_args or "--train-samples" in model_args:
                found[f"{family}/{os.path.basename(os.path.dirname(path))}"] = model_args
    return found


def parallel_sizes(model_args: dict, depth: int = 2) -> dict[str, int]:
    """The config's parallel sizes, PP made ``depth``, DP the smallest that the expert layout divides and that
    splits the data-parallel groups (dense and expert) into the config's optimizer instances."""
    def size(flag, default=1):
        return int(model_args.get(flag, default) or default)
    tp, cp = size("--tensor-model-parallel-size"), size("--context-parallel-size")
    ep = size("--expert-model-parallel-size")
    etp = size("--expert-tensor-parallel-size", tp)
    instances = size("--num-distributed-optimizer-instances")
    dp = math.lcm(etp * ep * instances // math.gcd(etp * ep * instances, tp * cp), instances)
    return {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "world": tp * depth * cp * dp}


def prepared(model_args: dict, workdir: str, depth: int = 2) -> tuple[list[str], int]:
    """The command line a user moving to Chimera would run at D = ``depth``, and its world size."""
    sizes = parallel_sizes(model_args, depth)
    heads = max(4, 2 * sizes["tp"])
    argv = ["--pipeline-model-parallel-size", str(depth), "--pipeline-schedule", "chimera", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--train-iters", "3",
            "--num-layers", str(LAYERS), "--hidden-size", str(16 * heads), "--num-attention-heads", str(heads)]
    steps = model_args.get("--step-batch-size-schedule")
    argv += ["--step-batch-size-schedule", _scaled_steps(steps, sizes["dp"])] if steps else \
        ["--global-batch-size", str(4 * sizes["dp"])]
    fixed = {"--num-layers", "--hidden-size", "--num-attention-heads", "--global-batch-size", "--train-iters",
             "--step-batch-size-schedule"}
    for flag, value in model_args.items():
        if flag in DROPPED or flag in fixed or flag in GPU_ONLY or value is False or value is None:
            continue
        if flag == "--transformer-impl":
            value = "local"
        elif flag == "--moe-token-dispatcher-type" and value == "flex":
            value = "alltoall"
        elif flag == "--num-query-groups":
            value = sizes["tp"]
        elif flag == "--ffn-hidden-size":
            value = 32 * heads
        elif flag == "--eval-global-batch-size":  # the schedule's last batch, as in the configs that set it
            value = 4 * sizes["dp"] * len(steps.split()) if steps else 4 * sizes["dp"]
        elif flag in SCALED:
            value = SCALED[flag](dict(sizes, value=str(value))) if callable(SCALED[flag]) else SCALED[flag]
        elif flag == "--wandb-exp-name":
            value = os.path.basename(workdir)
        elif flag in ("--save", "--load") and "$" in str(value):
            value = os.path.join(workdir, "checkpoints")  # one folder, as a user's launcher points both at it
        elif isinstance(value, str) and "$" in value:
            value = os.path.join(workdir, flag.strip("-"))
        argv += [flag] if value is True else [flag] + _values(value, flag in SEVERAL)
    return argv, sizes["world"]


def _values(value, several: bool = False) -> list[str]:
    """A flag's values as the functional tests' launcher passes them: a list, or a string of several
    written ``"[a b]"`` (or ``"a b"`` for a flag that takes several: ``SEVERAL``), becomes one word per value."""
    if isinstance(value, list):
        return [str(v) for v in value]
    text = str(value)
    if text.startswith("[") and text.endswith("]") and "," not in text:
        return text[1:-1].split()
    return text.split() if several else [text]


def parsed(argv: list[str], world: int) -> str | None:
    """None if the parser takes it, else the one line it printed."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(io.StringIO()):
            parse_args(argv, world_size=world)
    except SystemExit:
        return out.getvalue().strip().splitlines()[-1] if out.getvalue().strip() else "exit without a line"
    return None


def blocking_flags(argv: list[str], world: int) -> tuple[str | None, list[str]]:
    """The first refusal's line, and every flag that stops the parser (each found by taking the one
    before it out); a refusal that names no flag ends the search."""
    first, flags = None, []
    for _ in range(12):
        line = parsed(argv, world)
        if line is None:
            break
        first = first or line
        match = re.search(r"error: (--[a-z0-9_-]+)", line)
        if not match or match.group(1) not in argv:
            flags.append(line)
            break
        flags.append(match.group(1))
        argv = _without(argv, match.group(1))
    return first, flags


def _without(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i] + argv[j:]


def out_of_scope(model_args: dict) -> str | None:
    """FSDP is outside the parser target (context parallelism and Muon left it with issue 45)."""
    if (model_args.get("--use-megatron-fsdp") or model_args.get("--use-torch-fsdp2")
            or model_args.get("--ckpt-format") == "fsdp_dtensor"):
        return "FSDP"
    return None


def survey(configs: dict[str, dict], workdir: str, depth: int = 2) -> dict[str, dict]:
    results = {}
    for name, model_args in configs.items():
        argv, world = prepared(model_args, os.path.join(workdir, name.replace("/", "_")), depth)
        first, flags = blocking_flags(argv, world)
        results[name] = {"argv": argv, "world": world, "passes": first is None, "refusal": first,
                         "blocking": flags, "out_of_scope": out_of_scope(model_args)}
    return results


def sample(results: dict[str, dict], k: int, max_world: int) -> list[str]:
    """Greedy cover: k passing configurations of at most ``max_world`` processes that together set the
    most distinct flags."""
    flags_of = {name: {a for a in r["argv"] if a.startswith("--")} for name, r in results.items()
                if r["passes"] and r["world"] <= max_world}
    chosen, covered = [], set()
    while flags_of and len(chosen) < k:
        best = max(sorted(flags_of), key=lambda n: len(flags_of[n] - covered))
        chosen.append(best)
        covered |= flags_of.pop(best)
    return chosen


def train(results: dict[str, dict], names: list[str], workdir: str) -> dict[str, int | None]:
    """3 iterations of each, one launch per world size; name -> return code (None: did not finish)."""
    from megatron.chimera.testing.cases import run_cases  # here: only --train launches
    codes = {}
    for world in sorted({results[n]["world"] for n in names}):
        cases = {n: results[n]["argv"] for n in names if results[n]["world"] == world}
        for name, proc in run_cases(world, cases, timeout=1800).items():
            codes[name] = proc.returncode
            if proc.returncode != 0:  # its error lines (the tail is the launcher's)
                said = [line for line in proc.stderr.splitlines() if re.search(r"Error|error:", line)]
                print(f"--- {name} failed ({proc.returncode}):\n" + "\n".join(said[-12:]), file=sys.stderr)
    return codes


def report(results: dict[str, dict]) -> str:
    in_scope = [r for r in results.values() if not r["out_of_scope"]]
    lines = [f"{sum(r['passes'] for r in results.values())} of {len(results)} configurations pass the parser; "
             f"{sum(r['passes'] for r in in_scope)} of the {len(in_scope)} that ask for no FSDP", "",
             "| stopping flag or refusal | configs |", "|---|---|"]
    counts = collections.Counter(f for r in results.values() for f in dict.fromkeys(r["blocking"]))
    lines += [f"| {flag[:140]} | {n} |" for flag, n in counts.most_common()]
    return "\n".join(lines)


def main():
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("checkout", help="a Megatron-LM checkout (its tests/functional_tests)")
    cli.add_argument("--json", help="write every configuration's result here")
    cli.add_argument("--train", type=int, default=0, help="train this many passing configurations, 3 iterations each")
    cli.add_argument("--depth", type=int, default=2, help="Chimera's D, the pipeline size every configuration runs")
    cli.add_argument("--max-world", type=int, default=8,
                     help="train only configurations of at most this many processes (each holds about 1 GB)")
    opts = cli.parse_args()
    os.environ.setdefault("RANK", "0")
    logging.disable(logging.INFO)  # the tokenizer's padding line, once per configuration
    with tempfile.TemporaryDirectory(prefix="megatron-configs-") as workdir:
        results = survey(training_configs(opts.checkout), workdir, opts.depth)
        print(report(results))
        if opts.train:
            names = sample(results, opts.train, opts.max_world)
            for name, code in train(results, names, workdir).items():
                results[name]["trained"] = code
                print(f"trained {name}: {'ok' if code == 0 else f'exit {code}'}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
