"""The pretraining program as a user runs it: the shipped corpus, tokenizer and preprocessing,
Chimera with evaluation, checkpoints that resume exactly (written in the background: --async-save),
load into another layout, and survive a crash mid-save, and profiler traces that show every action.
The resume in a new launch, the crash and the loads into one process are launches of their own, as on
a cluster. The other runs share one launch per world size (megatron.chimera.testing's cases launcher),
each with its own output and exit code; a case that loads an earlier case's checkpoint does so through
a new ``pretrain`` (a new Trainer, its optimizer, loss scaler and data built afresh) in the same processes."""
import json
import os
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from chimera_schedules.tools.planner import Precision, model_state_bytes
from megatron.chimera.arguments import parse_args
from megatron.chimera.testing.cases import run_cases
from megatron.chimera.testing.launch import VALID, losses, run, train_args
from megatron.chimera.testing.plans import plan_of
from megatron.chimera.testing.run_files import tensorboard_scalars, wandb_history

CHIMERA2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]
# Megatron-LM's optional log series, to TensorBoard and to W&B (offline, everything under the test's folder)
SERIES = ["--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard", "--timing-log-level", "1",
          "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
          "--wandb-project", "chimera-tests", "--wandb-exp-name", "uninterrupted"]
ASYNC = ["--async-save", "--use-persistent-ckpt-worker"]  # Megatron-LM's validate_args wants both
FAULTY = ["-m", "megatron.chimera.testing.pretrain_with_faults"]  # pretrain_gpt.py with fault_hooks.py


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("ckpt") / "a"
    wandb = {f"WANDB_{d}_DIR": str(save.parent / "wandb_home") for d in ("CONFIG", "CACHE", "DATA")}
    proc = run(2, *train_args(corpus, *CHIMERA2, "--save", str(save), "--save-interval", "2", "--verify-integrity",
                              "--tensorboard-dir", str(save.parent / "tb"), *SERIES, *ASYNC,
                              "--wandb-save-dir", str(save.parent / "wandb")), env={"WANDB_MODE": "offline", **wandb})
    return proc, save


def test_uninterrupted_run_logs_like_megatron(uninterrupted):
    proc, save = uninterrupted
    assert len(losses(proc)) == 4
    assert "elapsed time per iteration (ms):" in proc.stdout and "throughput (tokens/s):" in proc.stdout
    assert {int(i) for i, _ in VALID.findall(proc.stdout)} == {2, 4}
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    files = os.listdir(save / "iter_0000002")  # megatron-core 0.19's torch_dist files, and our manifest
    # integrity.json: megatron-core's manifest, written with --verify-integrity
    assert {f for f in files if not f.endswith(".distcp")} == {".metadata", "manifest.json", "metadata.json",
                                                               "integrity.json"}
    assert {f.split("_")[2] for f in files if f.endswith(".distcp")} == {"0", "1"}  # written by both ranks
    written = os.listdir(save.parent / "tb")
    assert any(f.startswith("events.out.tfevents") for f in written), f"no TensorBoard event file in {written}"
    # the saved args differ by rank (rank, local_rank): Megatron-LM's preprocessing keeps megatron-core quiet
    assert not any("common state dict differs" in out for out in (proc.stdout, proc.stderr)), proc.stderr[-3000:]
    # --async-save: each save is handed to the writer, then published once written; Megatron-LM's timer says how
    # long each stopped training
    for i in (2, 4):
        scheduled = proc.stdout.index(f" scheduled an async checkpoint save at iteration {i} to {save}\n")
        assert scheduled < proc.stdout.index(f" saved checkpoint at iteration {i} to {save}/iter_000000{i}\n")
    assert len(re.findall(r"\n    save-checkpoint \.+: \(\d+\.\d\d, \d+\.\d\d\)\n", proc.stdout)) == 2


SERIES_LINE = re.compile(r" grad norm: (\S+) \| num zeros: (\d+\.0) \| params norm: (\S+) \| number of skipped")
# Megatron-LM's tags (training_log, evaluate_and_print_results), each with its ' vs samples' twin ...
PAIRED = {"learning-rate", "batch-size", "lm loss", "loss-scale", "world-size", "grad-norm", "num-zeros", "params-norm",
          "lm loss validation", "lm loss validation ppl"}
# ... and without one: the timers (level 1, seconds) and the time per iteration
TIMES = {"iteration-time", "forward-backward-time", "optimizer-clip-main-grad-time", "optimizer-count-zeros-time",
         "optimizer-inner-step-time", "optimizer-time"}
MEMORY = {"mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes", "mem-allocated-count"}


def test_megatron_lms_log_series_reach_the_line_tensorboard_and_wandb(uninterrupted):
    """The iteration line carries 'num zeros' and 'params norm' after 'grad norm', as Megatron-LM's;
    TensorBoard has Megatron-LM's tags (the memory ones on CUDA only: a CPU has no caching allocator),
    written every iteration (--tensorboard-log-interval 1); the W&B offline run logged the same keys."""
    proc, save = uninterrupted
    printed = SERIES_LINE.findall(proc.stdout)
    assert len(printed) == 4, f"iteration lines with the series: {printed}"
    board = tensorboard_scalars(str(save.parent / "tb"))
    memory = MEMORY if torch.cuda.is_available() else set()
    expected = PAIRED | {f"{tag} vs samples" for tag in PAIRED} | TIMES | memory
    assert expected <= board.keys(), f"missing TensorBoard tags: {sorted(expected - board.keys())}"
    norms = [v for _, v in board["params-norm"]]
    assert all(abs(v - float(p)) <= 6e-4 for v, (_, _, p) in zip(norms, printed, strict=True)), (norms, printed)
    assert [s for s, _ in board["params-norm vs samples"]] == [4, 8, 12, 16], board["params-norm vs samples"]
    assert [s for s, _ in board["lm loss validation ppl"]] == [2, 4], board["lm loss validation ppl"]
    history = wandb_history(str(save.parent / "wandb"))
    plain = {tag for tag in board if not tag.endswith(" vs samples")}
    assert plain | {"samples vs steps"} == history.keys(), f"W&B keys {sorted(history)}, TensorBoard {sorted(plain)}"
    logged = history["params-norm"]
    assert [s for s, _ in logged] == [1, 2, 3, 4] and [v for _, v in logged] == pytest.approx(norms, rel=1e-6), logged


def test_resume_in_a_new_launch_repeats_the_uninterrupted_losses(uninterrupted, corpus, tmp_path):
    proc, save = uninterrupted
    resume = tmp_path / "resume"
    shutil.copytree(save / "iter_0000002", resume / "iter_0000002")
    (resume / "latest_checkpointed_iteration.txt").write_text("2")
    # without megatron-core's gloo groups beside the others, which nothing of ours uses
    again = run(2, *train_args(corpus, *CHIMERA2, "--load", str(resume), "--verify-integrity",
                               "--disable-gloo-process-groups"))
    assert "loaded checkpoint" in again.stdout
    assert losses(again) == {3: losses(proc)[3], 4: losses(proc)[4]}
    assert VALID.findall(again.stdout)[-1] == VALID.findall(proc.stdout)[-1]


def test_chimera_checkpoint_loads_into_one_process(uninterrupted, corpus):
    proc, save = uninterrupted
    single = run(1, *train_args(corpus, "--load", str(save)))
    chimera_valid = float(VALID.findall(proc.stdout)[-1][1])
    single_valid = float(VALID.findall(single.stdout)[-1][1])
    assert abs(single_valid - chimera_valid) <= 1e-6 * chimera_valid


def test_crash_while_an_async_save_is_in_flight_keeps_the_previous_one(corpus, tmp_path):
    """--async-save: checkpoint 2 is published once its writers are done, while training goes on; every rank
    dies while checkpoint 4, written in the background, is being finalised, before it is published. A new
    launch resumes from checkpoint 2. (A synchronous save publishes through the same steps, at once:
    tests/unit/test_recipe_flags_loop.py fails one before it is published.) That run saves --ckpt-format
    torch (iteration 3), which Megatron-LM's own load_checkpoint reads into a plain GPTModel: its loss on
    batch 3 is the loss the run logged at iteration 4."""
    save, legacy = tmp_path / "crash", tmp_path / "legacy"
    proc = run(2, *FAULTY, *train_args(corpus, *CHIMERA2, "--save", str(save), "--save-interval", "2", *ASYNC)[1:],
               env={"CHIMERA_TEST_KILL_DURING_SAVE": "4"}, check=False)
    assert proc.returncode != 0
    assert "scheduled an async checkpoint save at iteration 4" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (save / "iter_0000004.tmp").is_dir() and not (save / "iter_0000004").exists()
    written = set(os.listdir(save / "iter_0000004.tmp"))  # every file but our manifest, which publishing writes
    assert written == set(os.listdir(save / "iter_0000002")) - {"manifest.json"}, written
    resumed = run(1, *train_args(corpus, "--load", str(save), "--use-checkpoint-opt_param-scheduler",
                                   "--ckpt-format", "torch", "--no-save-optim", "--save", str(legacy),
                                   "--save-interval", "3", "--eval-iters", "0"))
    assert "loaded checkpoint from" in resumed.stdout and "at iteration 2" in resumed.stdout
    assert list(losses(resumed)) == [3, 4]
    assert probe("load", str(legacy), "--", *train_args(corpus)[1:], "--probe-batch", "3", "--probe-step", "3") \
        == losses(resumed)[4]


def probe(*argv: str) -> str:
    """The loss the megatron-core probe printed."""
    return run(1, "-m", "megatron.chimera.testing.mcore_checkpoint_probe", *argv).stdout.split()[-1]


def test_megatron_lms_load_checkpoint_resumes_the_torch_formats_optimizer_state(corpus, tmp_path):
    """--ckpt-format torch with the optimizer state, saved in one process at iteration 3, read by Megatron-LM's own
    load_checkpoint with the optimizer megatron-core's get_megatron_optimizer builds and Megatron-LM's LR scheduler
    (the probe's ``step``): one training step on batch 3 from what it loaded gives the loss the run logged at
    iteration 5, which needs the run's moments, step count, and each parameter group's learning rate and weight
    decay. The run counts its LR schedule in samples (--train-samples), as Megatron-LM's scheduler does (with
    --train-iters ours counts iterations, and Megatron-LM's load refuses the schedule); its gradient is not clipped
    (the probe's Megatron-LM clips CUDA gradients only)."""
    flags = train_args(corpus, "--train-samples", "20", "--clip-grad", "0", "--eval-iters", "0")
    at = flags.index("--train-iters")
    flags = flags[1:at] + flags[at + 2:]
    saved = run(1, "pretrain_gpt.py", *flags, "--ckpt-format", "torch", "--save", str(tmp_path), "--save-interval", "3")
    assert probe("step", str(tmp_path), "--", *flags, "--probe-batch", "3", "--probe-step", "3") == losses(saved)[5]


def test_chimera_checkpoint_loads_with_megatron_lms_load_checkpoint(uninterrupted, corpus):
    """Megatron-LM's own load_checkpoint of the Chimera run's --save directory (iteration 2, as its
    --ckpt-step picks) into a plain GPTModel: its loss on batch 2 is the loss Chimera logged at
    iteration 3, the first one computed from the iteration-2 weights. With --verify-integrity, megatron-core
    checks the files against the integrity manifest Chimera's save wrote."""
    proc, save = uninterrupted
    assert probe("load", str(save), "--", *train_args(corpus)[1:], "--probe-batch", "2", "--probe-step", "2",
                 "--verify-integrity") \
        == losses(proc)[3]


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2",
       "--moe-layer-freq", "[0]+[1]*3", "--moe-shared-expert-intermediate-size", "32", "--disable-bias-linear",
       "--eval-iters", "0", "--global-batch-size", "8"]
FP16 = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "1", *CHIMERA2]
MUON = ["--optimizer", "muon", "--bf16", *CHIMERA2]
# profiled: mock data, two iterations, the executor's ranges traced in the second
PROFILED = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
             "--mock-data", "--vocab-size", "128", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
             "chimera", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
             "--lr-decay-style", "constant", "--train-iters", "2", "--eval-iters", "1", "--num-workers", "0"]
MTP = ["--position-embedding-type", "rope", "--mtp-num-layers", "1"]  # DeepSeek-V3's MTP (Megatron-LM wants rope)
LAYOUT = "--pipeline-model-parallel-layout"
MODEL_STATE = re.compile(r"model state \(bytes\) \| parameters: (\d+) \| main parameters: (\d+) \| gradients: (\d+) \|"
                         r" optimizer: (\d+) \| total: (\d+)")


@pytest.fixture(scope="module")
def four_ranks(corpus, tmp_path_factory):
    """The 4-process runs, in one launch: each saving run before the run that resumes from it."""
    d4, moe, cp = tmp_path_factory.mktemp("d4"), tmp_path_factory.mktemp("moe"), tmp_path_factory.mktemp("cp")
    return run_cases(4, {
        "chimera D=4": train_args(corpus, "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera",
                                  "--save", str(d4), "--save-interval", "2", "--eval-iters", "0", "--train-iters", "3",
                                  "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"),
        "1f1b D=2 TP=2": train_args(corpus, "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                    "--pipeline-schedule", "1f1b", "--eval-iters", "0", "--train-iters", "3",
                                    "--make-vocab-size-divisible-by", "64", "--load", str(d4 / "iter_0000002")),
        "moe chimera EP=2": train_args(corpus, *MOE, *CHIMERA2, "--expert-model-parallel-size", "2", "--save", str(moe),
                                       "--save-interval", "2", "--check-weight-hash-across-dp-replicas-interval", "2"),
        "moe 1f1b EP=1": train_args(corpus, *MOE, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
                                    "--load", str(moe / "iter_0000002")),
        "chimera CP=2": train_args(corpus, *CHIMERA2, "--context-parallel-size", "2", "--save", str(cp),
                                   "--save-interval", "2", "--eval-iters", "0", "--train-iters", "3"),
        "chimera DP=2 from CP=2": train_args(corpus, *CHIMERA2, "--eval-iters", "0", "--train-iters", "3",
                                             "--load", str(cp / "iter_0000002")),
    })


@pytest.fixture(scope="module")
def two_ranks(corpus, tmp_path_factory):
    """The 2-process runs, in one launch (after Megatron-LM's own save, in a process of its own); the
    profiled run last, so that no profiler is left on for another case."""
    mcore, fp16, distopt, traces, mtp, legacy, muon, chain = (tmp_path_factory.mktemp(n) for n in (
        "mcore", "fp16", "distopt", "traces", "mtp", "legacy", "muon", "chain"))
    expected = probe("save", str(mcore), "--", *train_args(corpus, "--train-iters", "1")[1:])
    bf16 = train_args(corpus, *CHIMERA2, "--bf16", "--save-interval", "2", "--train-iters", "5")
    return expected, run_cases(2, {
        "megatron-lm torch_dist": train_args(corpus, *CHIMERA2, "--train-iters", "1", "--load",
                                             str(mcore / "torch_dist"), "--finetune"),
        "megatron-lm legacy": train_args(corpus, *CHIMERA2, "--train-iters", "1", "--load", str(mcore / "torch"),
                                         "--no-load-optim"),
        "fp16": train_args(corpus, *FP16, "--save", str(fp16), "--save-interval", "2", "--eval-iters", "0"),
        "fp16 resumed": train_args(corpus, *FP16, "--load", str(fp16 / "iter_0000002"), "--eval-iters", "0"),
        "muon": train_args(corpus, *MUON, "--use-distributed-optimizer", "--save", str(muon), "--save-interval", "2",
                           "--eval-iters", "0"),
        "muon resumed": train_args(corpus, *MUON, "--load", str(muon / "iter_0000002"), "--eval-iters", "0"),
        "sharded": bf16 + ["--use-distributed-optimizer", "--save", str(distopt / "sharded"), "--log-memory-per-rank"],
        "plain": bf16 + ["--load", str(distopt / "sharded" / "iter_0000002"), "--save", str(distopt / "plain")],
        "sharded again": bf16 + ["--use-distributed-optimizer", "--load", str(distopt / "plain" / "iter_0000004")],
        "mtp Et|tttmL": train_args(corpus, *MTP, *CHIMERA2, LAYOUT, "Et|tttmL", "--save", str(mtp),
                                   "--save-interval", "2"),
        "mtp resumed Ettt|tmL": train_args(corpus, *MTP, *CHIMERA2, LAYOUT, "Ettt|tmL",
                                           "--load", str(mtp / "iter_0000002")),
        "mtp resumed even 1f1b": train_args(corpus, *MTP, "--pipeline-model-parallel-size", "2",
                                            "--pipeline-schedule", "1f1b", "--load", str(mtp / "iter_0000002")),
        "torch format": train_args(corpus, *CHIMERA2, "--ckpt-format", "torch", "--save", str(legacy),
                                   "--save-interval", "2", "--eval-iters", "0"),
        "torch format resumed": train_args(corpus, *CHIMERA2, "--load", str(legacy / "iter_0000002"),
                                           "--eval-iters", "0"),
        **successor_chain(corpus, chain),
        "model state": train_args(corpus, *CHIMERA2, "--untie-embeddings-and-output-weights", "--train-iters", "1",
                                  "--log-memory-per-rank", "--bf16", "--use-distributed-optimizer"),
        "profiled": PROFILED + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                                "--profile-step-end", "2", "--profile-ranks", "0", "1",
                                "--tensorboard-dir", str(traces)],
    }), traces, mtp, muon


# Chimera's checkpoint resumed by V-Half, whose by BitPipe, whose by Chimera: one iteration each, on the
# uninterrupted run's learning-rate schedule (its 4 iterations)
CHAIN = (("chimera", 1), ("v-half", 2), ("bitpipe", 3), ("chimera", 4))


def successor_chain(corpus, folder) -> dict:
    out = {}
    for i, (schedule, iteration) in enumerate(CHAIN):
        flags = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, "--eval-iters", "0",
                 "--train-iters", str(iteration), "--lr-decay-iters", "4", "--save", str(folder / str(iteration)),
                 "--save-interval", "1"]
        loads = ["--load", str(folder / str(iteration - 1) / f"iter_{iteration - 1:07d}"),
                 "--use-checkpoint-opt_param-scheduler"] if i else []
        out[f"chain {schedule} {iteration}"] = train_args(corpus, *flags, *loads)
    return out


def ok(runs: dict, name: str):
    proc = runs[name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


PARAMETERS = re.compile(r" > number of parameters on \(tensor, pipeline\) model parallel rank \(\d+, \d+\): (\d+) "
                        r"\(pipeline (\d+), stage (\d+)\)")


def stage_counts(proc) -> dict[int, int]:
    """Model stage -> its parameter count, from Megatron-LM's startup lines (every copy of a stage the same)."""
    counts = {}
    for count, _, stage in PARAMETERS.findall(proc.stdout):
        assert counts.setdefault(int(stage), int(count)) == int(count)
    return counts


def test_a_checkpoint_resumes_under_another_layout_an_even_split_and_one_process(two_ranks, corpus):
    """An MTP model saved by Chimera with 1 and 3 layers per stage resumes with 3 and 1, with the even
    split under 1F1B, and in one process, each repeating the uninterrupted losses (fp32 sums in
    another order: 1e-6). The startup's per-stage parameter counts follow the layout, and the
    checkpoint keys MTP as megatron-core does, next to the stacked layers."""
    _, runs, _, mtp, _ = two_ranks
    saved = ok(runs, "mtp Et|tttmL")
    assert " mtp_1 loss: " in saved.stdout  # Megatron-LM's iteration-line field
    single = run(1, *train_args(corpus, *MTP, "--load", str(mtp / "iter_0000002")))
    for resumed in (ok(runs, "mtp resumed Ettt|tmL"), ok(runs, "mtp resumed even 1f1b"), single):
        assert list(losses(resumed)) == [3, 4]
        for i in (3, 4):
            assert abs(float(losses(resumed)[i]) / float(losses(saved)[i]) - 1) < 1e-6
    saved_counts, moved_counts = stage_counts(saved), stage_counts(ok(runs, "mtp resumed Ettt|tmL"))
    layer = (moved_counts[0] - saved_counts[0]) // 2  # Et -> Ettt: two layers more on stage 0 ...
    assert layer > 0 and saved_counts[1] - moved_counts[1] == 2 * layer  # ... and two fewer on stage 1
    keys = FileSystemReader(str(mtp / "iter_0000002")).read_metadata().state_dict_metadata
    assert any(k.startswith("mtp.layers.0.") for k in keys) and "decoder.layers.mlp.linear_fc1.weight" in keys
    extra = [k for k in keys if k.startswith(("decoder.layers.1.", "mtp.layers.1."))]
    assert extra == [], f"keys of layers that do not exist: {extra}"


def test_checkpoints_cross_between_chimera_and_its_successors(two_ranks, uninterrupted):
    """Chimera's checkpoint resumes under V-Half, V-Half's under BitPipe, BitPipe's (two copies of each
    stage, V-shaped) under Chimera again, each iteration's loss the uninterrupted Chimera run's."""
    runs, reference = two_ranks[1], losses(uninterrupted[0])
    for schedule, iteration in CHAIN:
        run_losses = losses(ok(runs, f"chain {schedule} {iteration}"))
        assert list(run_losses) == [iteration], f"{schedule}: trained iterations {list(run_losses)}"
        loss, expected = float(run_losses[iteration]), float(reference[iteration])
        assert abs(loss / expected - 1) < 1e-6, \
            f"{schedule} at iteration {iteration}: loss {loss}, {expected} uninterrupted"


def test_megatron_lm_and_legacy_checkpoints_load_into_chimera(two_ranks):
    """A GPTModel saved by Megatron-LM's own save_checkpoint (torch_dist), and the same weights in
    Megatron-LM's legacy per-rank files (PP=2), start Chimera with the loss that model has in one process."""
    expected, runs, *_ = two_ranks
    dist, legacy = ok(runs, "megatron-lm torch_dist"), ok(runs, "megatron-lm legacy")
    assert losses(dist)[1] == losses(legacy)[1] == expected


def test_torch_format_is_megatron_lms_per_rank_files_and_resumes_exactly(two_ranks):
    """--ckpt-format torch: worker i writes its down-pipeline copy as pipeline rank i, in the files Megatron-LM's
    legacy save writes, with the stage's optimizer state as megatron-core's FP32Optimizer gives it (torch's AdamW
    state dict over megatron-core's parameter groups: with and without weight decay) and the LR scheduler's.
    Resumed with its optimizer state (each of Chimera's two copies of a stage from that stage's file), iterations
    3 and 4 repeat the uninterrupted run's losses exactly."""
    runs = two_ranks[1]
    saved, resumed = ok(runs, "torch format"), ok(runs, "torch format resumed")
    folder = re.search(r"saved checkpoint at iteration 2 to (\S+)", saved.stdout).group(1)
    assert sorted(os.listdir(folder)) == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001"], os.listdir(folder)
    last = torch.load(os.path.join(folder, "mp_rank_00_001", "model_optim_rng.pt"), weights_only=False)
    assert sorted(last) == ["args", "checkpoint_version", "iteration", "model", "opt_param_scheduler", "optimizer",
                            "rng_state"], sorted(last)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in last["model"] and "output_layer.weight" in last["model"]
    assert sorted(last["rng_state"][0]) == ["cuda_rng_state", "np_rng_state", "random_rng_state",
                                            "rng_tracker_states", "torch_rng_state"], last["rng_state"]
    groups, state = last["optimizer"]["param_groups"], last["optimizer"]["state"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and all(g["max_lr"] == 3e-3 for g in groups), groups
    weights = [k for k, v in last["model"].items() if torch.is_tensor(v) and not k.endswith("_extra_state")]
    assert sorted(i for g in groups for i in g["params"]) == sorted(state) == list(range(len(weights))), state
    # Megatron-LM's scheduler counts samples: 2 iterations of 4
    assert {int(s["step"]) for s in state.values()} == {2} and last["opt_param_scheduler"]["num_steps"] == 8
    assert losses(resumed) == {3: losses(saved)[3], 4: losses(saved)[4]}


def test_chimera_d4_checkpoint_reshards_into_1f1b_d2_tp2(four_ranks):
    """Weights and AdamW moments re-cut by dist_checkpointing: the resumed iteration 3 repeats the
    Chimera run's (tensor parallelism reorders fp32 sums, hence 1e-5). As in Megatron-LM, TP=2 pads the
    vocabulary to a multiple of 128 x 2 unless --make-vocab-size-divisible-by keeps the shape. The Chimera
    run shards its optimizer state (--use-distributed-optimizer, Chimera's two copies of each stage) and says
    --dist-ckpt-optim-fully-reshardable, Megatron-LM's flag for the format it always writes: the state loads
    at another data-parallel size, tensor-parallel size, layout and schedule, without the distributed optimizer."""
    chimera, resharded = ok(four_ranks, "chimera D=4"), ok(four_ranks, "1f1b D=2 TP=2")
    assert list(losses(resharded)) == [3]
    for i in (3,):
        assert abs(float(losses(resharded)[i]) / float(losses(chimera)[i]) - 1) < 1e-5


def test_moe_expert_parallel_chimera_checkpoint_resumes_at_ep1_under_1f1b(four_ranks):
    """A model mixing dense and MoE layers (megatron-core keys each layer on its own, by its number in
    the whole model, and each expert by its number among all experts) saved by Chimera D=2 with
    expert parallelism 2 resumes without expert parallelism under 1F1B D=2, with the uninterrupted
    run's losses (fp32: they differ only in the order of sums)."""
    whole, resumed = ok(four_ranks, "moe chimera EP=2"), ok(four_ranks, "moe 1f1b EP=1")
    assert list(losses(resumed)) == [3, 4]
    for i in (3, 4):
        assert abs(float(losses(resumed)[i]) / float(losses(whole)[i]) - 1) < 1e-5
    assert "load_balancing_loss:" in resumed.stdout


def test_context_parallel_checkpoint_resumes_without_context_parallelism(four_ranks):
    """A checkpoint does not depend on CP: Chimera D=2 x CP=2 saved at iteration 2 (the CP ranks hold the same
    weights, megatron-core's replica ids over DP x CP) resumes at CP=1 x DP=2, its iteration 3 the CP run's
    (fp32: the sums' order differs)."""
    saved, resumed = ok(four_ranks, "chimera CP=2"), ok(four_ranks, "chimera DP=2 from CP=2")
    assert "context parallelism (CP=2): megatron-core's local attention" in saved.stdout, saved.stdout[-3000:]
    assert list(losses(resumed)) == [3]
    assert abs(float(losses(resumed)[3]) / float(losses(saved)[3]) - 1) < 1e-5, (losses(saved), losses(resumed))


def test_weight_hashes_match_across_every_copy_as_megatron_lm_logs_it(four_ranks):
    """--check-weight-hash-across-dp-replicas-interval 2 under Chimera D=2 x DP=2 x EP=2 (every copy of every
    stage, both pipelines and both replicas, experts over their own groups): Megatron-LM's line before training
    and every 2 iterations, once (rank 0's)."""
    run = ok(four_ranks, "moe chimera EP=2")
    lines = [line for line in run.stdout.splitlines() if line.startswith(">>> Weight hashes match")]
    assert lines == [f">>> Weight hashes match after {i} iterations..." for i in (0, 2, 4)], lines


def test_fp16_resume_repeats_losses_and_loss_scale(two_ranks):
    """Megatron-LM's --fp16: the fp32 main weights and the dynamic loss scale are checkpointed, so a
    resumed run logs the uninterrupted run's losses and loss scales."""
    whole, again = ok(two_ranks[1], "fp16"), ok(two_ranks[1], "fp16 resumed")
    scales = re.findall(r"iteration\s+(\d+)/.* loss scale: (\S+) \|", whole.stdout)
    assert [s for _, s in scales] == ["2048.0", "4096.0", "8192.0", "16384.0"]  # doubles after each clean step
    assert losses(again) == {3: losses(whole)[3], 4: losses(whole)[4]}
    assert re.findall(r"iteration\s+(\d+)/.* loss scale: (\S+) \|", again.stdout) == scales[2:]


def test_muon_momentum_is_checkpointed_and_resumes_exactly(two_ranks, corpus, capsys):
    """--optimizer muon: each matrix Muon steps saves its momentum under megatron-core's key, the rest AdamW's
    moments, gathered from their owners under the layer-wise distributed optimizer, and a resumed run (without
    it) logs the uninterrupted run's losses and gradient norms (iteration 4's differ without the momentum).
    Resuming its optimizer state with AdamW fails in one line."""
    whole, again = ok(two_ranks[1], "muon"), ok(two_ranks[1], "muon resumed")
    norms = re.compile(r"iteration\s+(\d+)/.* grad norm: (\S+) \|")
    assert losses(again) == {3: losses(whole)[3], 4: losses(whole)[4]}
    assert norms.findall(again.stdout) == norms.findall(whole.stdout)[2:]
    saved = FileSystemReader(str(two_ranks[4] / "iter_0000002")).read_metadata().state_dict_metadata
    held = lambda state: {k.removeprefix(f"optimizer.state.{state}.") for k in saved  # noqa: E731
                          if k.startswith(f"optimizer.state.{state}.")}
    layers = {f"decoder.layers.{m}.weight" for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                      "mlp.linear_fc1", "mlp.linear_fc2")}
    # megatron-core marks the word embedding and output layer, not the learned position embedding, for Adam
    assert held("momentum_buffer") == layers | {"embedding.position_embeddings.weight"}, sorted(saved)
    assert held("exp_avg") == held("exp_avg_sq") and "embedding.word_embeddings.weight" in held("exp_avg")
    assert not held("exp_avg") & held("momentum_buffer"), "a parameter saved with both optimizers' state"
    with pytest.raises(SystemExit):
        parse_args(train_args(corpus, *CHIMERA2, "--bf16", "--load", str(two_ranks[4] / "iter_0000002"))[1:],
                   world_size=2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--optimizer=adam: the checkpoint in" in err and "holds muon's" in err, err


def test_distributed_optimizer_checkpoints_load_without_it_and_back(two_ranks):
    """--bf16 with and without --use-distributed-optimizer compute the same numbers, and both write the
    whole optimizer state (the sharded one gathers it): a run without it resumes the sharded run's
    checkpoint, a sharded run resumes that one's, and both repeat the sharded run's losses as printed."""
    runs = two_ranks[1]
    sharded, plain, back = ok(runs, "sharded"), ok(runs, "plain"), ok(runs, "sharded again")
    assert losses(plain) == {i: v for i, v in losses(sharded).items() if i > 2}
    assert losses(back) == {5: losses(sharded)[5]}
    assert len(MODEL_STATE.findall(plain.stdout)) == 1 and "max model state (bytes) |" in plain.stdout
    per_rank = re.findall(r"rank (\d) " + MODEL_STATE.pattern, sharded.stdout)
    assert sorted(r[0] for r in per_rank) == ["0", "1"]
    for _, *fields, total in per_rank:
        assert sum(map(int, fields)) == int(total) and int(fields[1]) > 0  # bf16: fp32 main weights exist


def test_model_state_line_matches_the_planners_formula(two_ranks):
    """Each rank's counted bytes are what the planner's model_state_bytes predicts for the stage copies
    it holds (untied embeddings: no stage shares a tensor with another), with --bf16
    --use-distributed-optimizer, where Chimera's two copies of a stage split its optimizer state."""
    proc = ok(two_ranks[1], "model state")
    held = {}
    for worker, count in re.findall(r"model parallel rank \(0, (\d)\): (\d+) \(pipeline", proc.stdout):
        held.setdefault(int(worker), []).append(int(count))
    lines = re.findall(r"rank (\d) " + MODEL_STATE.pattern, proc.stdout)
    assert len(lines) == 2
    for rank, *fields in lines:
        want = [sum(model_state_bytes(p, 1, 2, Precision(True, True))[k] for p in held[int(rank)])
                for k in ("parameters", "main parameters", "gradients", "optimizer", "total")]
        assert [int(x) for x in fields] == pytest.approx(want, rel=1e-3), (rank, fields, want)


def pp_ranges(events) -> list[str]:
    """The names of a trace's ``PP:`` ranges, in the order they started."""
    return [e["name"] for e in sorted(events, key=lambda e: e["ts"]) if e.get("name", "").startswith("PP:")]


def test_a_profiled_two_rank_run_traces_one_range_per_action_of_each_worker(two_ranks):
    """Megatron-LM's profiler flags on iteration 2: each rank's trace holds the executor's range for
    every action of its worker's lowered list, in order."""
    ok(two_ranks[1], "profiled")
    lowered = plan_of(parse_args(PROFILED, world_size=2)).lowered
    traces = {}
    for path in two_ranks[2].glob("*.pt.trace.json"):
        trace = json.loads(path.read_text())
        traces[trace["distributedInfo"]["rank"]] = pp_ranges(trace["traceEvents"])
    assert sorted(traces) == [0, 1]
    for rank, names in traces.items():  # world 2, PP 2: worker = rank
        assert names == [f"PP:{a}" for a in lowered.workers[rank]], (rank, names)
