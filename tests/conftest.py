import json
import multiprocessing
import multiprocessing.process
import os
import subprocess
import sys

import pytest

# one intra-op thread per process, as every launch here runs (launch.py's ENV): two pytest workers share two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
# megatron-core's jit_fuser is torch.compile: on the CPU every process that first runs a fused function (squared
# ReLU, quick GELU, the output gate, L2 norm) builds C++ with inductor, about 17 s of the one-process harness
# launch alone. The suite's runs and their references all run those functions eagerly instead (torch.compile
# returns them unchanged): a comparison never mixes the two, and the compiled kernels are torch's, not ours.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# megatron-core and the trainer are imported by the fixtures that use them, never here: the schedule library's
# tests (tests/schedules) import neither (tests/unit/test_layers.py checks it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TIERS = {"unit": "unit", "schedules": "unit", "integration": "integration"}  # folder -> marker


def pytest_collection_modifyitems(items):
    """Mark each test by its tier, which its folder holds by cost: ``unit`` (tests/unit, and tests/schedules for
    the schedule library, which imports no megatron-core) runs in this process and launches nothing, which
    ``launches_nothing`` enforces; ``integration`` launches processes; ``slow`` (marked in the modules) are the
    integration tests that take longest (Slurm, SIGTERM, silent ranks, packaging). Markers select, never skip;
    the README's command runs every tier."""
    for item in items:
        kind = TIERS.get(os.path.basename(os.path.dirname(str(item.path))))
        if kind:
            item.add_marker(getattr(pytest.mark, kind))
    first = {}
    for item in items:
        first[item.path] = min(first.get(item.path, 3), _start_rank(item))
    items.sort(key=lambda item: first[item.path])  # stable: a file's tests keep their order


def _start_rank(item) -> int:
    """When a file should start under xdist (whole files to two workers, each taking the next file as it runs
    out): the harness (the longest, about 5 minutes) first, then the slow integration files, whose waits
    (Slurm's queue, timeouts) overlap the rest, then the other launches, then the in-process tests, which are
    many and short and so fill the workers' last minutes evenly."""
    if item.path.name == "test_training.py":
        return 0
    if item.get_closest_marker("integration"):
        return 1 if item.get_closest_marker("slow") else 2
    return 3


# what a launch of ours runs: the programs the tests launch as a user does (pretrain_gpt.py, torchrun, our modules)
OURS = ("pretrain_gpt.py", "torch.distributed.run", "megatron.chimera", "chimera_schedules", "benchmarks", "scripts/")


@pytest.fixture(autouse=True)
def launches_nothing(request):
    """A unit test that launches one of our programs (pretrain_gpt.py, torchrun, ``python -m`` a module of ours) or
    starts a new interpreter through multiprocessing (spawn) fails, naming it: its tier is integration. Tools
    (ruff, bash), torch's own probes and forked DataLoader workers are not launches of a program under test."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    popen_init = subprocess.Popen.__init__

    def refuse_ours(self, args, *rest, **kwargs):
        words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
        if os.path.basename(words[0]).startswith(("python", "torchrun")) and any(o in w for w in words for o in OURS):
            pytest.fail(f"{request.node.nodeid} launches {' '.join(words[:4])}: a launching test belongs in "
                        "tests/integration")
        popen_init(self, args, *rest, **kwargs)

    def refuse_interpreter(process, *args, **kwargs):
        method = process._start_method or multiprocessing.get_start_method()
        if method != "fork":
            pytest.fail(f"{request.node.nodeid} starts a {method} process: a launching test belongs in "
                        "tests/integration")
        start(process, *args, **kwargs)

    start = multiprocessing.process.BaseProcess.start
    # patched and put back here, not with the test's monkeypatch: that one is undone after every other fixture
    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = refuse_ours, refuse_interpreter
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen_init, start


def _global_state() -> dict:
    """What megatron-core, Megatron-LM and torch hold per process that a test could leave changed, described so
    that equal states compare equal: megatron-core's parallel state (each group by its ranks, each rank and
    size it keeps at module level), its micro-batch calculator, Megatron-LM's global args and torch's
    deterministic switch. Nothing while no test has imported megatron-core."""
    if "megatron.core.parallel_state" not in sys.modules:
        return {}
    import torch
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.training import global_vars

    held = {f"parallel_state.{name}": _described(value) for name, value in vars(parallel_state).items()
            if name.startswith("_") and name.lstrip("_")[:1].isupper()}
    held["num_microbatches_calculator"] = num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    held["megatron.training args"] = global_vars._GLOBAL_ARGS
    held["torch deterministic"] = torch.are_deterministic_algorithms_enabled()
    return held


def _described(value):
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        try:
            return "group", tuple(dist.get_process_group_ranks(value))
        except (KeyError, RuntimeError):
            return "destroyed group"
    if isinstance(value, (list, tuple)):
        return tuple(_described(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


@pytest.fixture(autouse=True)
def leaves_no_global_state(request):
    """Fails a test that leaves process-wide state changed (the next test would run in it, so results would
    depend on the order), naming what changed."""
    before = _global_state()
    yield
    after = _global_state()
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    if changed:
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        pytest.fail(f"{request.node.nodeid} left process-wide state changed: {', '.join(changed[:4])}{more}")


@pytest.fixture
def parallel_state_restored(one_process_group):
    """For a test that initialises megatron-core's parallel state again (``setup_parallel``, a Trainer): the
    session's one-process state is made again afterwards, so that the tests after it run in it."""
    from megatron.core import parallel_state

    yield
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)


@pytest.fixture(scope="session")
def one_process_group():
    """A one-process gloo group with megatron-core's parallel state and the CPU layer, for tests that
    build megatron-core models inside the test process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.chimera.distributed.ports import free_port
    from megatron.chimera.model import cpu_compat

    port = free_port()
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


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory):
    """A small GPT-2 byte-level BPE (vocab.json, merges.txt) and the same tokenizer saved as a local
    HuggingFace directory."""
    from tokenizers import ByteLevelBPETokenizer  # with transformers, seconds to import: the tokenizer tests' alone
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("gpt2")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # GPT-2 shows these bytes as chr(256 + k)
    symbols = [chr(b) for b in printable] + [chr(256 + k) for k in range(len(others))]
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]
    vocab = {s: i for i, s in enumerate(symbols + ["".join(m) for m in merges] + ["<|endoftext|>"])}
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    bpe = ByteLevelBPETokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(out / "hf")
    return out


def pytest_terminal_summary(terminalreporter):
    """Say in the suite's summary when the Slurm tests were skipped, and why (scripts/install_slurm.sh could not
    install Slurm here), so a green run without them is never silent about it."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "test_slurm.py" in r.nodeid]
    if skipped:
        reason = skipped[0].longrepr[2] if isinstance(skipped[0].longrepr, tuple) else str(skipped[0].longrepr)
        terminalreporter.write_line(f"Slurm tests skipped ({len(skipped)}): {reason.removeprefix('Skipped: ')}")
