import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def one_process_group():
    """A one-process gloo group with megatron-core's parallel state and the CPU layer, for tests that
    build megatron-core models inside the test process."""
    from megatron.core import parallel_state
    from megatron.training import cpu_compat

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cpu_compat.apply()
    cpu_compat.apply()  # idempotent
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The shipped corpus through the user-facing tools: a SentencePiece model, then .bin/.idx.
    Returns the training flags that use them."""
    out = tmp_path_factory.mktemp("data")

    def tool(*argv):
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    tool("scripts/train_tokenizer.py", "--input", "data/corpus.jsonl", "--model-prefix", str(out / "tok"),
         "--vocab-size", "512")
    proc = tool("scripts/preprocess_data.py", "--input", "data/corpus.jsonl", "--output-prefix", str(out / "corpus"),
                "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(out / "tok.model"),
                "--append-eod", "--workers", "2", "--log-interval", "10")
    assert "Processed 27 documents" in proc.stdout
    return ["--data-path", str(out / "corpus_text_document"), "--split", "90,10,0",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(out / "tok.model")]
