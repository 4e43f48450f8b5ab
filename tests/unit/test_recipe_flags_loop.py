"""Megatron-LM's recipe flags of issue 34 that reach megatron-core's config or the trainer's behaviour, in one
process: --recompute-modules, --moe-shared-expert-overlap, --moe-router-force-load-balancing,
--no-check-for-nan-in-loss-and-grad, --dist-ckpt-strictness, --trust-remote-code."""
import contextlib
import json
from dataclasses import replace

import pytest
import torch
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput, model_parallel_cuda_manual_seed
from torch.distributed.checkpoint import FileSystemReader

from megatron.chimera.arguments import parse_args
from megatron.chimera.checkpoint.async_saves import async_saves
from megatron.chimera.checkpoint.checkpointing import (
    LATEST,
    check_digests,
    load_checkpoint,
    read_common,
    save_checkpoint,
)
from megatron.chimera.checkpoint.format import CheckpointError
from megatron.chimera.checkpoint.states import DataPosition
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.loop import TrainingStopped, _Progress
from megatron.chimera.model import recompute
from megatron.chimera.model.chunk import build_chunk, shared_expert_overlap, transformer_config
from megatron.chimera.observability.hooks import Hooks
from megatron.chimera.observability.series import Writers
from megatron.chimera.observability.startup import print_building
from megatron.chimera.testing.one_step import forward_backward_once, one_process_trainer
from megatron.chimera.testing.plans import plan_of

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--eval-iters", "0", "--num-workers", "0"]
# layer 0 dense, layer 1 mixture-of-experts with a shared expert
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8", "--moe-layer-freq", "[0,1]",
       "--moe-shared-expert-intermediate-size", "8", "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]


def gradients(flags: list[str]) -> tuple[dict, int]:
    """One chunk's parameter gradients after a forward and backward of a fixed batch, and the bytes autograd
    kept for the backward."""
    _, grads, saved = forward_backward_once(TINY + flags)
    return grads, saved


@pytest.mark.parametrize("modules", [["core_attn", "mlp", "layernorm", "shared_experts"], ["moe"]])
def test_selective_recompute_modules_keep_the_gradients_and_save_memory(parallel_state_restored, modules):
    """Each module megatron-core's local layers recompute reaches the config, keeps the gradients bit for bit
    and keeps fewer bytes for the backward."""
    spec = ModelSpec.from_args(parse_args(TINY + MOE + SELECTIVE + modules, world_size=1))
    assert transformer_config(spec, 2).recompute_modules == modules
    plain, plain_bytes = gradients(MOE)
    recomputed, recomputed_bytes = gradients(MOE + SELECTIVE + modules)
    assert all(torch.equal(plain[n], recomputed[n]) for n in plain), \
        f"gradients that differ: {[n for n in plain if not torch.equal(plain[n], recomputed[n])]}"
    assert recomputed_bytes < plain_bytes


def test_megatron_cores_layernorm_checkpoint_still_asks_for_fp8_without_it():
    """Why model/recompute.py exists: megatron-core 0.19 reads CheckpointWithoutOutput's default fp8=False as fp8
    on (``fp8 is not None``). When a release fixes that, this fails and the module can go."""
    recompute.apply()
    checkpoint = object.__new__(CheckpointWithoutOutput)
    getattr(CheckpointWithoutOutput.__init__, "__wrapped__", CheckpointWithoutOutput.__init__)(checkpoint)
    assert checkpoint.fp8


def test_moe_act_is_transformer_engines_and_startup_says_so_once(parallel_state_restored, capsys):
    args = parse_args(TINY + MOE + ["--moe-grouped-gemm"] + SELECTIVE + ["moe_act", "mlp"], world_size=1)
    spec = ModelSpec.from_args(args)
    assert transformer_config(spec, 2).recompute_modules == ["mlp"]  # megatron-core refuses moe_act without TE's GEMMs
    capsys.readouterr()
    print_building(spec, transformer_engine=False, device_type="cpu")
    out = capsys.readouterr().out
    assert out.count("--recompute-modules") == 1
    assert (" > --recompute-modules: moe_act only in Transformer Engine's layers (no effect with megatron-core's "
            "local layers here); recomputed: mlp") in out


def test_shared_expert_overlap_is_off_on_the_cpu_and_startup_says_so(parallel_state_restored, capsys):
    args = parse_args(TINY + MOE + ["--moe-shared-expert-overlap"], world_size=1)
    spec = ModelSpec.from_args(args)
    assert shared_expert_overlap(spec, "cuda")  # megatron-core's field, as Megatron-LM sets it, on a GPU
    assert not transformer_config(spec, 2, device_type="cpu").moe_shared_expert_overlap
    capsys.readouterr()
    print_building(spec, transformer_engine=False, device_type="cpu")
    out = capsys.readouterr().out
    assert out.count("--moe-shared-expert-overlap") == 1 and "off on the CPU" in out


def routes(flags: list[str]) -> list[torch.Tensor]:
    """The MoE layer's routing maps of two random inputs, each routed from the same RNG states."""
    args = parse_args(TINY + MOE + flags, world_size=1)
    model = build_chunk(ModelSpec.from_args(args), plan_of(args), 0, torch.device("cpu"))
    router = model.decoder.layers[1].mlp.router
    maps = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(args.seed)
        maps.append(router(torch.randn(8, 2, 16))[1])
    return maps


def test_forced_load_balancing_routes_at_random_whatever_the_input(parallel_state_restored):
    """megatron-core's random logits (RandomSTE) replace the router's: drawn from the expert-parallel RNG state,
    so two inputs routed from the same state go to the same experts."""
    forcing = parse_args(TINY + MOE + ["--moe-router-force-load-balancing"], world_size=1)
    assert transformer_config(ModelSpec.from_args(forcing), 2).moe_router_force_load_balancing
    forced, learned = routes(["--moe-router-force-load-balancing"]), routes([])
    assert torch.equal(*forced) and not torch.equal(*learned)


@pytest.mark.parametrize("extra, needle", [
    (SELECTIVE + ["moe_act"], "--recompute-modules=moe_act: needs --moe-grouped-gemm (megatron-core's rule)"),
    (SELECTIVE + ["mla_up_proj"], "--recompute-modules=mla_up_proj: needs --multi-latent-attention"),
    (SELECTIVE + ["attention"], "--recompute-modules=attention: is not one of megatron-core's modules"),
    (SELECTIVE + ["shared_experts", "--moe-shared-expert-overlap"],
     "--recompute-modules=shared_experts: cannot be combined with --moe-shared-expert-overlap"),
    (["--moe-shared-expert-overlap", "--moe-token-dispatcher-type", "allgather"],
     "--moe-shared-expert-overlap=True: needs --moe-token-dispatcher-type alltoall"),
    (["--recompute-activations", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
      "--split-backward"], "--recompute-granularity=selective: megatron-core's activation recomputation runs in a "
                           "whole backward only, which --pipeline-schedule 1f1b --split-backward splits"),
    (["--dist-ckpt-strictness", "return_all"], "--dist-ckpt-strictness=return_all: pretrain_gpt.py runs"),
])
def test_what_cannot_run_fails_in_one_line(capsys, extra, needle):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY + MOE + extra, world_size=2 if "--split-backward" in extra else 1)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and needle in err and len(err.splitlines()) == 1, err


class _NaNWeights(Hooks):
    """NaN word embeddings before the iteration: a NaN loss and gradient norm, as a diverged run has."""

    def before_iteration(self, trainer, iteration: int) -> None:
        with torch.no_grad():
            trainer.models[0].embedding.word_embeddings.weight.fill_(float("nan"))


def trainer(flags: list[str], hooks: Hooks = Hooks()):
    return one_process_trainer(TINY + flags, hooks)


@pytest.mark.parametrize("checked", [True, False])
def test_the_nan_check_skips_counts_and_stops_only_when_on(parallel_state_restored, checked):
    """On (Megatron-LM's default) a NaN step is skipped, counted, and --max-consecutive-nan-iterations of them
    stop the run; with --no-check-for-nan-in-loss-and-grad nothing checks: the step is taken, as in Megatron-LM."""
    flags = ["--max-consecutive-nan-iterations", "1"] + ([] if checked else ["--no-check-for-nan-in-loss-and-grad"])
    with trainer(flags, _NaNWeights()) as t:
        stats = t.train_step(0)
        assert stats["lm loss"] != stats["lm loss"]  # NaN
        expected = (True, True, 0) if checked else (False, False, 1)
        assert (stats["skipped"], stats["nan"], t.optimizer_steps()) == expected
        progress = _Progress(t.job.train, t.job.data, t.job.log, 0, Writers(t.job.log), t.timers)
        with pytest.raises(TrainingStopped) if checked else contextlib.nullcontext():
            progress.record(stats, 1, 1e-3, None)


def test_dist_ckpt_strictness_reaches_the_load(parallel_state_restored, tmp_path, caplog):
    """Our own checkpoint loads under raise_all (the _extra_state objects this loader leaves out on purpose are
    not reported); without the optimizer (--no-load-optim) its keys are missing: raise_all fails, log_all logs
    them and loads."""

    def load(t) -> tuple[int, int]:
        position = DataPosition(t.job.data.global_batch_size)
        load_checkpoint(t.states(), position, t.job.checkpoint, t.rt)
        return position.iteration, position.consumed_samples

    with trainer(["--save", str(tmp_path), "--save-interval", "1"]) as t:
        save_checkpoint(t.states(), DataPosition(2, 1, 2), t.job.checkpoint, t.rt, t.job.megatron_args)
    flags = ["--load", str(tmp_path), "--dist-ckpt-strictness"]
    with trainer(flags + ["raise_all"]) as t:
        assert load(t) == (1, 2), "our own checkpoint loads under raise_all at its iteration and samples"
    with trainer(flags + ["raise_all", "--no-load-optim"]) as t, pytest.raises(CheckpointError, match="missing"):
        load(t)
    with trainer(flags + ["log_all", "--no-load-optim"]) as t:
        caplog.clear()
        assert load(t) == (1, 2), "log_all loads despite the optimizer's keys, missing from the request"
        assert "optimizer.state.exp_avg" in caplog.text and "_extra_state" not in caplog.text, caplog.text


def test_trust_remote_code_reaches_huggingfaces_auto_tokenizer(gpt2_files, monkeypatch):
    from megatron.core.tokenizers.text.libraries import huggingface_tokenizer  # imports transformers: seconds

    asked = []
    real = huggingface_tokenizer.AutoTokenizer.from_pretrained

    def from_pretrained(*args, **kwargs):
        asked.append(kwargs["trust_remote_code"])
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_tokenizer.AutoTokenizer, "from_pretrained", from_pretrained)
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(gpt2_files / "hf")]
    for flag in ([], ["--trust-remote-code"]):
        parse_args(TINY + hf + flag, world_size=1)
    assert asked == [False, True]


def test_an_async_save_writes_the_synchronous_files_and_publishes_them_only_at_finalisation(parallel_state_restored,
                                                                                           tmp_path):
    """--async-save: the save returns with its files handed to a writer; training goes on, changing the weights;
    the ``latest`` file still names the previous checkpoint until the save is finalised, and then the files are,
    byte for byte, those a synchronous save of the same state wrote."""
    background, sync = tmp_path / "async", tmp_path / "sync"
    with trainer(["--save", str(background), "--save-interval", "1", "--async-save",
                  "--use-persistent-ckpt-worker"]) as t:
        spec, published = t.job.checkpoint, []
        assert spec.async_save, "--async-save with --use-persistent-ckpt-worker reaches the checkpoint spec"
        save_checkpoint(t.states(), DataPosition(2, 1, 2), spec, t.rt, t.job.megatron_args)
        save_checkpoint(t.states(), DataPosition(2, 2, 4), replace(spec, save=str(sync)), t.rt,
                        t.job.megatron_args)
        saves = async_saves()
        save_checkpoint(t.states(), DataPosition(2, 2, 4), spec, t.rt, t.job.megatron_args,
                        on_published=published.append, saves=saves)
        t.train_step(1)
        assert (background / LATEST).read_text() == "1" and not (background / "iter_0000002").exists(), \
            "an async save in flight is not published"
        saves.close()
        assert published == [str(background / "iter_0000002")] and (background / LATEST).read_text() == "2"
    assert written(sync / "iter_0000002") == written(background / "iter_0000002"), \
        "the async save's files differ from the synchronous save's"


def written(folder) -> tuple:
    """What a torch_dist checkpoint holds: the tensor files (their sizes and digests), the index of what is where
    in them, and the common state (.metadata also records the folder it was written to and a random save id)."""
    check_digests(str(folder), str(folder))  # the manifest's digests, taken by the writers, are the files'
    files = json.loads((folder / "manifest.json").read_text())["files"]
    metadata = FileSystemReader(str(folder)).read_metadata()
    return ({name: digest for name, digest in files.items() if name.endswith(".distcp")}, metadata.state_dict_metadata,
            metadata.storage_data, read_common(str(folder), "torch_dist", str(folder)))


def test_a_save_that_fails_before_it_is_published_leaves_the_previous_one(parallel_state_restored, tmp_path):
    """A rank that fails once its files are written (as tests/integration's crash during an async save): the
    ``latest`` file still names the previous checkpoint, and the new one is left in its ``.tmp`` folder."""

    def crash():
        raise RuntimeError("crashed before publishing")

    with trainer(["--save", str(tmp_path), "--save-interval", "1"]) as t:
        save_checkpoint(t.states(), DataPosition(2, 1, 2), t.job.checkpoint, t.rt, t.job.megatron_args)
        with pytest.raises(RuntimeError, match="crashed before publishing"):
            save_checkpoint(t.states(), DataPosition(2, 2, 4), t.job.checkpoint, t.rt,
                            t.job.megatron_args, crash)
    assert (tmp_path / LATEST).read_text() == "1"
    assert (tmp_path / "iter_0000002.tmp").is_dir() and not (tmp_path / "iter_0000002").exists()


def test_use_checkpoint_args_takes_the_models_settings_from_the_checkpoint(parallel_state_restored, tmp_path,
                                                                        monkeypatch):
    """Megatron-LM's --use-checkpoint-args: the model's shape and dropout come from the args the checkpoint
    saved (through Megatron-LM's load_args_from_checkpoint), so a resume need not repeat them. The flags are
    parsed as pretrain_gpt.py parses them, before any process group exists (Megatron-LM's reader of the latest
    file would otherwise agree on it with the other ranks, on a GPU)."""
    with trainer(["--save", str(tmp_path), "--save-interval", "1", "--hidden-dropout", "0.25"]) as t:
        save_checkpoint(t.states(), DataPosition(2, 1, 2), t.job.checkpoint, t.rt, t.job.megatron_args)
    shapeless = ["--seq-length", "8", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
                 "--vocab-size", "64", "--eval-iters", "0"]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    args = parse_args(shapeless + ["--load", str(tmp_path), "--use-checkpoint-args"], world_size=1)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.hidden_dropout) == (2, 16, 2, 0.25), args
