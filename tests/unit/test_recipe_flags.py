"""The model flags of Megatron-LM's current recipes (issue 34) reach megatron-core with Megatron-LM's values:
Llama 3.1's RoPE scaling and --padded-vocab-size as its GPT builder passes them to GPTModel, gpt-oss's
attention and MLP as its core_transformer_config_from_args sets them; the learnable attention sink is an
ordinary parameter of its stage. Impossible values fail in one line."""

import pytest
import torch
from megatron.core.config import is_experimental_enabled
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.training.argument_utils import core_transformer_config_from_args, gpt_config_from_args

from megatron.chimera.arguments import parse_args
from megatron.chimera.checkpoint.states import ModelChunks
from megatron.chimera.config.model_spec import ModelSpec
from megatron.chimera.model import chunk
from megatron.chimera.model.parameter_names import TIED_NAME, is_gated
from megatron.chimera.optim.gradients import is_expert
from megatron.chimera.optim.precision import MainParams
from megatron.chimera.testing.plans import plan_of

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--vocab-size", "100", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--no-rope-fusion"]
# Megatron-LM's gpt-oss recipe (examples/gptoss), its attention and MLP flags, the window scaled to 4 tokens
GPT_OSS = ["--softmax-type", "learnable", "--window-size", "4,0", "--window-attn-skip-freq", "2", "--quick-geglu",
           "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0", "--position-embedding-type", "rope"]
SINK = "self_attention.core_attention.softmax_offset"


def _chunk(flags: list[str], stage: int = 0, world_size: int = 1):
    args = parse_args(BASE + flags, world_size=world_size)
    model_parallel_cuda_manual_seed(args.seed)  # as the Trainer does
    plan = plan_of(args)
    return args, plan, chunk.build_chunk(ModelSpec.from_args(args), plan, stage, torch.device("cpu"))


def _megatron_config(args):
    return core_transformer_config_from_args(args)


def _windowed(config, first: int = 0) -> list[bool]:
    """Which of the config's layers megatron-core gives a sliding window, read as it reads them."""
    return [is_layer_window_attention(config.window_size, config.window_attn_skip_freq, first + i + 1)
            for i in range(config.num_layers)]


def test_gpt_oss_flags_set_megatron_lms_config_fields():
    args = parse_args(BASE + GPT_OSS + ["--disable-bf16-reduced-precision-matmul"])
    spec = ModelSpec.from_args(args)
    ours, megatron = chunk.transformer_config(spec, 4), _megatron_config(args)
    for field in ("softmax_type", "window_size", "gated_linear_unit", "activation_func", "glu_linear_offset",
                  "activation_func_clamp_value", "disable_bf16_reduced_precision_matmul"):
        assert getattr(ours, field) == getattr(megatron, field), field
    assert (ours.softmax_type, ours.window_size, ours.glu_linear_offset) == ("learnable", (4, 0), 1.0)
    assert ours.activation_func.__name__ == "quick_gelu" and ours.gated_linear_unit
    # the stage of layers 1 and 2 (of 0-3) windows them as Megatron-LM windows the model's layers 2 and 3
    assert _windowed(ours) == _windowed(megatron) == [True, False, True, False]
    assert _windowed(chunk.transformer_config(spec, 2, first_layer=1)) == [False, True]


def test_disable_bf16_reduced_precision_matmul_sets_torchs_flag_as_megatron_core_does():
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_bf16_reduced_precision_reduction = True
        ModelSpec.from_args(parse_args(BASE + ["--bf16", "--disable-bf16-reduced-precision-matmul"]))
        assert not matmul.allow_bf16_reduced_precision_reduction
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved


def test_rope_scaling_and_vocab_reach_gpt_model_as_megatron_lms_builder_passes_them(one_process_group):
    flags = ["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "8",
             "--rotary-seq-len-interpolation-factor", "2", "--rotary-base", "500000", "--padded-vocab-size", "160"]
    args, _, model = _chunk(flags)
    megatron = gpt_config_from_args(args, config=model.config)  # what Megatron-LM's pretrain_gpt.py builds
    expected = RotaryEmbedding(kv_channels=8, rotary_percent=megatron.rotary_percent,
                               seq_len_interpolation_factor=megatron.seq_len_interpolation_factor,
                               rotary_base=megatron.rotary_base, rope_scaling=megatron.rope_scaling,
                               rope_scaling_factor=megatron.rope_scaling_factor, use_cpu_initialization=True)
    assert megatron.rope_scaling and megatron.seq_len_interpolation_factor == 2
    assert torch.equal(model.rotary_pos_emb(16), expected(16))
    assert not torch.equal(model.rotary_pos_emb(16), _chunk(["--position-embedding-type", "rope",
                                                             "--rotary-base", "500000"])[2].rotary_pos_emb(16))
    assert args.padded_vocab_size == megatron.vocab_size == 160  # not padded to 128, as in Megatron-LM
    assert model.embedding.word_embeddings.weight.shape[0] == 160


def test_enable_experimental_sets_megatron_cores_switch(one_process_group):
    _chunk(["--enable-experimental"])
    assert is_experimental_enabled()
    _chunk([])
    assert not is_experimental_enabled()


def test_the_attention_sink_is_an_ordinary_parameter_of_its_stage(one_process_group):
    args, plan, stage1 = _chunk(GPT_OSS + ["--pipeline-model-parallel-size", "2"], stage=1, world_size=2)
    first = plan.layout.first_layer(1)
    sinks = {name: p for name, p in stage1.named_parameters() if name.endswith(SINK)}
    assert [p.global_name for p in sinks.values()] == [f"decoder.layers.{first + i}.{SINK}" for i in range(2)]
    for name, p in sinks.items():
        assert p.requires_grad and p.shape == (4,) and p.partition_dim == 0 and p.tensor_model_parallel
        assert not is_expert(p) and not p.sums_over_tensor_parallel and p.global_name != TIED_NAME
        assert name in stage1.state_dict()
    # its layers window as Megatron-LM's layers 3 and 4 (of 1-4) do
    windows = [layer.self_attention.core_attention.scale_mask_softmax.window_size for layer in stage1.decoder.layers]
    assert windows == [(4, 0), None]
    # megatron-core's checkpoint key (its head axis split over TP), the layers stacked over the whole model
    main = MainParams({(0, 1): stage1}, rt=None, tied=False)
    saved = ModelChunks.of({(0, 1): stage1}, [(0, 1)], plan.layout, main).sharded_state_dict()
    saved = saved["model0"]
    for i, name in enumerate(sinks):
        item = saved[name]
        assert (item.key, item.global_shape, item.global_offset) == (f"decoder.layers.{SINK}", (4, 4), (first + i, 0))
    tokens = torch.arange(16).view(1, 16)
    stage1.set_input_tensor(torch.randn(16, 1, 32))
    stage1(None, None, None, labels=tokens).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in sinks.values()), \
        f"sinks without a gradient: {[n for n, p in sinks.items() if p.grad is None or p.grad.abs().sum() == 0]}"


def test_the_attention_sink_starts_equal_in_every_copy_and_splits_over_tp_like_heads(one_process_group,
                                                                                  monkeypatch):
    def sinks(model):
        return [p.detach().clone() for name, p in model.named_parameters() if name.endswith(SINK)]

    reference = sinks(_chunk(GPT_OSS)[2])  # one process: layers 0-3
    assert len(reference) == 4
    assert all(map(torch.equal, reference, sinks(_chunk(GPT_OSS)[2]))), "a second build initialised other sinks"
    stage1 = _chunk(GPT_OSS + ["--pipeline-model-parallel-size", "2"], stage=1, world_size=2)[2]
    assert all(map(torch.equal, sinks(stage1), reference[2:])), "stage 1's sinks are not layers 2-3's of one process"
    whole = sinks(_chunk(GPT_OSS + ["--num-attention-heads", "8"])[2])  # 8 heads, as one process holds them
    halves = []
    for rank in (0, 1):  # a TP=2 rank holds 4 of the 8 heads
        monkeypatch.setattr(chunk, "_tensor_parallel", lambda gname, rank=rank: (2, rank))
        halves.append(sinks(_chunk(GPT_OSS)[2]))
    assert all(torch.equal(torch.cat(pair), w) for *pair, w in zip(*halves, whole)), \
        "the two TP ranks' sinks, joined, are not the whole layer's"


@pytest.mark.parametrize("extra, world_size, needle", [
    (["--rope-scaling-factor", "16"], 1, "--rope-scaling-factor=16.0: pretrain_gpt.py runs 8.0 only"),
    (["--rotary-seq-len-interpolation-factor", "0"], 1, "--rotary-seq-len-interpolation-factor=0: must be positive"),
    (["--padded-vocab-size", "64"], 1, "--padded-vocab-size=64: must hold the tokenizer's 100 ids"),
    (["--padded-vocab-size", "129", "--tensor-model-parallel-size", "2"], 2,
     "--padded-vocab-size=129: must be a multiple of --tensor-model-parallel-size (2)"),
    (["--quick-geglu", "--swiglu"], 1, "--quick-geglu=True: cannot be combined with --swiglu"),
    (["--window-size=-1,0"], 1, "--window-size=-1,0: with a negative (unlimited) side runs in Transformer"),
    (["--window-size", "4"], 1, "--window-size=4: takes the window's left and right sizes"),
    (["--window-size", "4,0", "--window-attn-skip-freq", "[1,0]"], 1,
     "--window-attn-skip-freq=[1, 0]: must give one entry per layer (4)"),
    (["--window-size", "4,0", "--window-attn-skip-freq", "2", "--mtp-num-layers", "1", "--position-embedding-type",
      "rope"], 1, "--mtp-num-layers=1: with --window-size and --window-attn-skip-freq is not supported yet"),
])
def test_impossible_recipe_flags_fail_in_one_line(capsys, extra, world_size, needle):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + extra, world_size=world_size)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and needle in err and len(err.splitlines()) == 1, err


def test_a_quick_geglu_fc1_is_split_over_tp_as_gate_and_up():
    config = ModelSpec.from_args(parse_args(BASE + ["--quick-geglu"])).config
    assert is_gated(config, "decoder.layers.0.mlp.linear_fc1.weight")
