"""Megatron-LM's MoE recipes and its current model recipes (recipes/moe/), scaled down, under Chimera with
expert parallelism. The DeepSeek-V2-Lite-style one runs exactly as in one process and carries the most:
multi-latent attention, a dense first layer, a shared expert, the alltoall dispatcher, --moe-grouped-gemm
(sequential experts on the CPU, said once); fp32 here (PRECISION empty), so the printed losses agree to the
digit. Of the current families each recipe is accepted as written and gpt-oss's trains in bf16; their
exactness is the equivalence harness's (FAMILIES in megatron/chimera/testing/equivalence.py)."""
import re
import shlex
import subprocess

import pytest

from megatron.chimera import parse_args
from megatron.chimera.distributed.ports import free_port
from megatron.chimera.testing.launch import ENV, ROOT

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \| seq_load_balancing_loss: (\S+) \|")


def recipe(name: str, tokenizer: str, **knobs: str) -> subprocess.CompletedProcess:
    env = {**ENV, "TOKENIZER_MODEL": tokenizer, "PRECISION": "", "MASTER_PORT": str(free_port()), **knobs}
    proc = subprocess.run(["bash", f"recipes/moe/{name}.sh", "--train-iters", "3", "--eval-iters", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_deepseek_v2_lite_recipe_under_chimera_with_expert_parallelism_equals_one_process(corpus):
    tokenizer = corpus[corpus.index("--tokenizer-model") + 1]
    chimera = recipe("deepseek_v2_lite", tokenizer)  # 4 processes: Chimera D=2 x EP=2
    alone = recipe("deepseek_v2_lite", tokenizer, NPROC="1", PP="1", EP="1", SCHEDULE="")
    assert "schedule chimera-direct (D=2" in chimera.stdout
    assert chimera.stdout.count("--moe-grouped-gemm: megatron-core's sequential experts instead") == 1
    assert LOSS.findall(chimera.stdout) == LOSS.findall(alone.stdout) and len(LOSS.findall(alone.stdout)) == 3


# Megatron-LM's current model recipes (issue 34), scaled down: (script, processes as written)
FAMILIES = {"qwen3_8b": 2, "qwen3_235b_a22b": 4, "kimi_k2": 4, "llama4_scout": 4, "deepseek_v3": 4, "gpt_oss": 4}


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_recipe_is_accepted_as_written(name, corpus):
    """Every flag of the recipe (bf16, Chimera D=2, expert parallelism) passes Megatron-LM's parser and
    our checks: none is refused. The command is the recipe's own (PRINT_COMMAND), parsed in this process."""
    env = {**ENV, "TOKENIZER_MODEL": corpus[corpus.index("--tokenizer-model") + 1], "PRINT_COMMAND": "1"}
    printed = subprocess.run(["bash", f"recipes/moe/{name}.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True).stdout
    program, *argv = shlex.split(printed)
    assert program == "pretrain_gpt.py" and "--bf16" in argv
    assert argv[argv.index("--pipeline-schedule") + 1] == "chimera"
    args = parse_args(argv, world_size=FAMILIES[name])
    assert args.pipeline_model_parallel_size == 2 and args.bf16


def test_gpt_oss_recipe_trains_in_bf16_as_written(corpus):
    """gpt-oss's recipe as written (bf16; sliding windows, attention sinks, the clamped GLU, alltoall
    experts over EP=2, the distributed optimizer with overlapped reduce and gather) under Chimera D=2."""
    proc = subprocess.run(["bash", "recipes/moe/gpt_oss.sh", "--train-samples", "24"], cwd=ROOT,
                          env={**ENV, "MASTER_PORT": str(free_port())}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "schedule chimera-direct (D=2" in proc.stdout
    assert len(re.findall(r"iteration\s+\d+/\s*3 \|.* lm loss: \S+ \|", proc.stdout)) == 3
