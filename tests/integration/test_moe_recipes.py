"""Megatron-LM's MoE recipes (recipes/moe/), scaled down, run under Chimera with expert
parallelism exactly as in one process. The DeepSeek-V2-Lite-style one carries the most: multi-latent
attention, a dense first layer, a shared expert, the alltoall dispatcher, --moe-grouped-gemm (sequential
experts on the CPU, said once); fp32 here (PRECISION empty), so the printed losses agree to the digit."""
import re
import subprocess

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
