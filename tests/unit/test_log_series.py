"""Megatron-LM's optional log series (observability/series.py): when and under which tags they reach
TensorBoard and W&B, the checks on the W&B flags, the logging level. The values themselves are checked
against one process in tests/integration/test_training.py, the files a run writes in test_pretraining.py."""
import importlib.util
import logging

import pytest

from megatron.chimera.arguments import parse_args
from megatron.chimera.config.job import job_config
from megatron.chimera.observability import series
from megatron.chimera.observability.series import Writers, memory_scalars, set_logging_level

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "6", "--lr", "1e-4", "--mock-data", "--vocab-size", "128", "--num-workers", "0"]


class Recorder:
    """A SummaryWriter's add_scalar and flush, or wandb's log, kept."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, step, value))

    def log(self, values, step):
        self.scalars += [(key, step, value) for key, value in values.items()]

    def flush(self):
        pass


def stats(loss: float) -> dict:
    return {"lm loss": loss, "grad norm": 1.5, "num zeros": 7, "params norm": 20.0, "skipped": False, "moe": {}}


def test_scalars_follow_tensorboard_log_interval_with_megatron_lms_tags(one_process_group):
    """Every --tensorboard-log-interval iterations, that iteration's values; '<tag> vs samples' at the
    consumed samples; W&B the plain tags and 'samples vs steps'."""
    log = job_config(parse_args(BASE + ["--tensorboard-log-interval", "3", "--log-world-size-to-tensorboard"])).log
    writers = Writers(log)
    writers.tensorboard, writers.wandb = Recorder(), Recorder()
    for i in range(1, 7):
        writers.iteration(stats(10.0 - i), i, 1e-3, None, 4, 2)
    board = writers.tensorboard.scalars
    assert [(step, v) for tag, step, v in board if tag == "lm loss"] == [(3, 7.0), (6, 4.0)], board
    assert [(step, v) for tag, step, v in board if tag == "lm loss vs samples"] == [(12, 7.0), (24, 4.0)], board
    tags = {tag for tag, _, _ in board}
    expected = {"learning-rate", "batch-size", "lm loss", "loss-scale", "world-size", "grad-norm", "num-zeros",
                "params-norm"}
    assert tags == expected | {f"{t} vs samples" for t in expected}, sorted(tags)
    assert {tag for tag, _, _ in writers.wandb.scalars} == expected | {"samples vs steps"}, writers.wandb.scalars


def test_validation_ppl_is_written_only_with_its_flag_and_capped_as_megatron_lm_caps_it(one_process_group):
    for flags, tags in (([], {"lm loss validation", "lm loss validation vs samples"}),
                        (["--log-validation-ppl-to-tensorboard"],
                         {"lm loss validation", "lm loss validation vs samples", "lm loss validation ppl",
                          "lm loss validation ppl vs samples"})):
        writers = Writers(job_config(parse_args(BASE + flags)).log)
        writers.tensorboard = Recorder()
        writers.validation(25.0, 2, 8)
        written = {tag: v for tag, _, v in writers.tensorboard.scalars}
        assert written.keys() == tags, written
    assert written["lm loss validation ppl"] == pytest.approx(4.851651954097903e08), written  # e^20


def test_wandb_without_its_package_stops_the_run_in_one_line_saying_how_to_install_it(monkeypatch, capsys, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + ["--wandb-project", "p", "--wandb-save-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.endswith("pip install wandb") and len(err.splitlines()) == 1, err


def test_wandb_needs_a_directory(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--wandb-project", "p"])
    err = capsys.readouterr().err.strip()
    assert err == "pretrain_gpt.py: error: --wandb-save-dir=None: is needed without --save (W&B writes under " \
                  "<--save>/wandb by default)", err


def test_memory_series_reads_megatron_lms_counters_of_the_cuda_allocator(monkeypatch):
    assert memory_scalars() == {} or series.torch.cuda.is_available(), "a CPU run has no allocator to read"
    counters = {"reserved_bytes.all.current": 4, "allocated_bytes.all.current": 3, "allocated_bytes.all.peak": 5,
                "allocation.all.current": 2}
    monkeypatch.setattr(series.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(series.torch.cuda, "memory_stats", lambda: counters)
    assert memory_scalars() == {"mem-reserved-bytes": 4, "mem-allocated-bytes": 3, "mem-max-allocated-bytes": 5,
                                "mem-allocated-count": 2}


def test_logging_level_sets_the_root_logger_as_megatron_lm_does(monkeypatch):
    """Before the process group exists, as pretrain calls it."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "40")
    set_logging_level(job_config(parse_args(BASE)).log.series)
    assert root.level == 40, "the environment variable without the flag"
    set_logging_level(job_config(parse_args(BASE + ["--logging-level", "30"])).log.series)
    assert root.level == 30, "the flag before the environment variable"
