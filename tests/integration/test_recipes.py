"""Megatron-LM's own example scripts (core_v0.16 to core_v0.19, the same flags:
examples/gpt3/train_gpt3_175b_distributed.sh and examples/llama/train_llama3_8b_h100_fp8.sh), flag for flag,
with the sizes scaled down and ``--pipeline-schedule chimera`` added, run under Chimera D=2.

Removed, and only these: the GPU-only fp8 flags. The GPT-3 script's --rampup-batch-size 16 16 5859375 (up to
its global batch of 1536) is scaled with the rest: 4 2 8 up to 8, so that its 4 iterations run batches of 4, 6,
8 and 8, each under its own Chimera schedule.
"""
import re
import subprocess
import sys

import pytest

from megatron.chimera.testing.cases import run_cases
from megatron.chimera.testing.launch import LOSS, ROOT, VALID

CHIMERA = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]


def gpt3(vocab: str, merges: str, data: str, out: str) -> list[str]:
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
             "--max-position-embeddings", "32", "--attention-backend", "auto"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "4", "--weight-decay", "0.1",
                "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
                "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
                "--lr-warmup-fraction", ".001", "--lr-decay-iters", "4", "--rampup-batch-size", "4", "2", "8"]
    parallel = ["--tensor-model-parallel-size", "1", *CHIMERA]
    data_args = ["--data-path", data, "--vocab-file", vocab, "--merge-file", merges, "--split", "949,50,1"]
    logging = ["--log-interval", "1", "--save-interval", "2", "--eval-interval", "2", "--save", out, "--load", out,
               "--eval-iters", "2", "--tensorboard-dir", out + "/tb"]
    return model + training + parallel + data_args + logging


def llama3(out: str) -> list[str]:
    model = ["--use-mcore-models", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "224",
             "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8",
             "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
             "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
             "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused",
             "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "32",
                "--lr-decay-samples", "24", "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001",
                "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
                "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
                "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235", "--overlap-grad-reduce",
                "--bf16", "--use-distributed-optimizer", "--overlap-param-gather"]
    parallel = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel", *CHIMERA]
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-cache-path",
            out + "/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files", "--num-workers", "1"]
    logging = ["--log-interval", "1", "--eval-iters", "2", "--eval-interval", "2", "--save-interval", "2",
               "--log-throughput", "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
               "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", out, "--load", out,
               "--tensorboard-dir", out + "/tb"]
    return model + training + parallel + data + logging


@pytest.fixture(scope="module")
def gpt2_corpus(gpt2_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2data")
    proc = subprocess.run([sys.executable, "scripts/preprocess_data.py", "--input", "data/corpus.jsonl",
                           "--output-prefix", str(out / "corpus"), "--tokenizer-type", "GPT2BPETokenizer",
                           "--vocab-file", str(gpt2_files / "vocab.json"),
                           "--merge-file", str(gpt2_files / "merges.txt"), "--append-eod"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return str(out / "corpus_text_document")


@pytest.fixture(scope="module")
def recipes(gpt2_files, gpt2_corpus, tmp_path_factory):
    """Both recipes, in one launch of 2 processes."""
    out = tmp_path_factory.mktemp("recipes")
    gpt = gpt3(str(gpt2_files / "vocab.json"), str(gpt2_files / "merges.txt"), gpt2_corpus, str(out / "gpt3"))
    return out, run_cases(2, {"gpt3": gpt, "llama3": llama3(str(out / "llama3"))})


def ran(recipes, name: str):
    proc = recipes[1][name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_megatron_lm_gpt3_recipe_runs_under_chimera(recipes):
    proc = ran(recipes, "gpt3")
    # --fp16 starts at Megatron-LM's loss scale 2^32: every step overflows and is skipped, the scale halves
    # from the second on (hysteresis 2), and, as in Megatron-LM, a line with no step has no lm loss
    lines = re.findall(r"iteration\s+(\d+)/.* loss scale: (\S+) \| number of skipped iterations:\s+(\d+)",
                       proc.stdout)
    assert lines == [("1", "4294967296.0", "1"), ("2", "2147483648.0", "1"), ("3", "1073741824.0", "1"),
                     ("4", "536870912.0", "1")]
    assert not LOSS.findall(proc.stdout)
    assert [int(i) for i, _ in VALID.findall(proc.stdout)] == [2, 4]
    assert [int(b) for b in re.findall(r"global batch size:\s+(\d+) \|", proc.stdout)] == [4, 6, 8, 8]
    assert " > batch-size ramp, 3 schedules: from sample 0: global batch size 4 (chimera-direct, N=4); from sample " \
           "4: global batch size 6 (chimera-direct, N=6); from sample 8: global batch size 8" in proc.stdout
    assert (recipes[0] / "gpt3" / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_megatron_lm_llama3_recipe_runs_under_chimera(recipes):
    proc = ran(recipes, "llama3")
    assert [int(i) for i, _ in LOSS.findall(proc.stdout)] == [1, 2, 3, 4]
    assert re.search(r"throughput per GPU \(TFLOP/s/GPU\): \d+\.\d", proc.stdout)
    assert "no checkpoint in" in proc.stdout and "saved checkpoint at iteration 4" in proc.stdout
