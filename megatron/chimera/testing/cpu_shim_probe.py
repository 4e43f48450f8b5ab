"""Which of cpu_compat's redirections megatron-core still needs on a CPU: each is undone in turn and
the megatron-core code that needed it is run. Prints one JSON object: "without", shim -> the error
without it, or null if megatron-core ran without it (then the shim can go); "control", the same runs
with every shim in place, which must all be null.

    python -m megatron.chimera.testing.cpu_shim_probe
"""
import contextlib
import importlib
import inspect
import json
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.strategies import async_utils  # noqa: E402
from megatron.core.models.common.embeddings import rotary_pos_embedding  # noqa: E402
from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import p2p_communication, schedules  # noqa: E402
from megatron.core.tensor_parallel import random  # noqa: E402
from megatron.core.transformer import utils  # noqa: E402
from megatron.core.transformer.moe import token_dispatcher  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron.chimera.distributed.ports import free_port  # noqa: E402
from megatron.chimera.model import cpu_compat  # noqa: E402

ORIGINAL = {"current_device": torch.cuda.current_device, "synchronize": torch.cuda.synchronize,
            "get_state": random._get_cuda_rng_state, "set_state": random._set_cuda_rng_state,
            "schedules.torch": schedules.torch, "utils.torch": utils.torch,
            "token_dispatcher.torch": token_dispatcher.torch,
            "maybe_move_tensor_to_cpu": token_dispatcher.maybe_move_tensor_to_cpu,
            "record_stream": torch.Tensor.record_stream,
            "pos_emb_on_this_cp_rank": rotary_pos_embedding.get_pos_emb_on_this_cp_rank}
PLAN_TORCH = {name: importlib.import_module(name).torch for name in cpu_compat.PLAN_MODULES}


def gpt(position="learned_absolute", experts=None, **config):
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            gradient_accumulation_fusion=False, num_moe_experts=experts, **config)
    return GPTModel(cfg, get_gpt_layer_local_spec(num_experts=experts), vocab_size=64, max_sequence_length=16,
                    position_embedding_type=position)


def alltoall_dispatcher():
    train(gpt(experts=4, moe_token_dispatcher_type="alltoall", add_bias_linear=False, moe_router_topk=2))


def split_sizes():
    """With expert parallelism the dispatcher hands its split sizes to all_to_all_single, which takes
    no tensor (a one-rank group never calls it, so it is called here as the dispatcher would)."""
    sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2]), as_numpy=True)
    dist.all_to_all_single(torch.empty(2), torch.ones(2), output_split_sizes=sizes, input_split_sizes=sizes)


def train(model, mask=True):
    tokens = torch.randint(0, 64, (1, 16))
    causal = torch.triu(torch.ones(1, 1, 16, 16), 1).bool() if mask else None
    model(tokens, torch.arange(16)[None], causal, labels=tokens).mean().backward()


def no_pipelining_schedule():
    model = gpt()

    def step(_, chunk):
        tokens = torch.randint(0, 64, (1, 16))
        out = chunk(tokens, torch.arange(16)[None], torch.triu(torch.ones(1, 1, 16, 16), 1).bool(), labels=tokens)
        return out, lambda o: (o.sum(), {"loss": o.sum().detach()})

    schedules.forward_backward_no_pipelining(forward_step_func=step, data_iterator=iter([None] * 2), model=[model],
                                             num_microbatches=2, seq_length=16, micro_batch_size=1)


def schedule_plan():
    """--overlap-moe-expert-parallel-comm's way through a chunk: its schedule plan's forward, then backward."""
    model, tokens = gpt(), torch.randint(0, 64, (1, 16))
    plan = model.build_schedule_plan(tokens, torch.arange(16)[None], torch.triu(torch.ones(1, 1, 16, 16), 1).bool(),
                                     labels=tokens)
    loss = TransformerModelChunkSchedulePlan.run(plan, None)
    TransformerModelChunkSchedulePlan.run(None, plan, b_grad=torch.ones_like(loss))


def plan_torch(proxy: bool):
    for name, original in PLAN_TORCH.items():
        importlib.import_module(name).torch = cpu_compat._CpuTorch() if proxy else original


def fresh_tracker():
    tracker = random.get_cuda_rng_tracker()  # megatron-core's own when ours is undone
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 123)
    train(gpt())


def synchronize_callers():
    """p2p (megatron-core's own schedules) and the async checkpoint writer call it; they need peers or a
    checkpoint to run, so: they still call it, and the call fails without the redirection."""
    assert all("torch.cuda.synchronize()" in inspect.getsource(m) for m in (p2p_communication, async_utils))
    torch.cuda.synchronize()


def rope_on_cp_rank():
    """RoPE with context parallelism cuts each CP rank's chunks out of its embedding; megatron-core builds the
    chunks' index on the GPU whatever the group's size, so a one-rank CP group shows it."""
    assert "get_pos_emb_on_this_cp_rank(" in inspect.getsource(rotary_pos_embedding.RotaryEmbedding.forward)
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank(torch.zeros(8, 1, 1, 4), 0,
                                                     parallel_state.get_context_parallel_group())


def redirect_rng_state(undo: bool):
    random._get_cuda_rng_state = ORIGINAL["get_state"] if undo else (lambda *a, **k: torch.empty(0, dtype=torch.uint8))
    random._set_cuda_rng_state = ORIGINAL["set_state"] if undo else (lambda *a, **k: None)


TRACKER = []  # cpu_compat's, seeded as the trainer seeds it


def set_tracker(tracker):
    random._CUDA_RNG_STATE_TRACKER, random._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker, tracker is not None


SHIMS = {  # name -> (undo, redo, what needs it)
    "current_device": (lambda: setattr(torch.cuda, "current_device", ORIGINAL["current_device"]),
                       lambda: setattr(torch.cuda, "current_device", lambda: torch.device("cpu")),
                       lambda: train(gpt("rope"))),
    "synchronize": (lambda: setattr(torch.cuda, "synchronize", ORIGINAL["synchronize"]),
                    lambda: setattr(torch.cuda, "synchronize", lambda *a, **k: None), synchronize_callers),
    "rng_tracker": (lambda: set_tracker(None), lambda: set_tracker(TRACKER[0]), fresh_tracker),
    "cuda_rng_state": (lambda: redirect_rng_state(True), lambda: redirect_rng_state(False),
                       lambda: train(gpt(recompute_granularity="full", recompute_method="uniform",
                                         recompute_num_layers=1))),
    "schedules_token_counter": (lambda: setattr(schedules, "torch", ORIGINAL["schedules.torch"]),
                                lambda: setattr(schedules, "torch", cpu_compat._CpuTorch()), no_pipelining_schedule),
    "default_causal_mask": (lambda: setattr(utils, "torch", ORIGINAL["utils.torch"]),
                            lambda: setattr(utils, "torch", cpu_compat._CpuTorch()), lambda: train(gpt(), mask=False)),
    "dispatcher_stream": (lambda: setattr(token_dispatcher, "torch", ORIGINAL["token_dispatcher.torch"]),
                          lambda: setattr(token_dispatcher, "torch", cpu_compat._CpuTorch()), alltoall_dispatcher),
    "dispatcher_split_sizes": (
        lambda: setattr(token_dispatcher, "maybe_move_tensor_to_cpu", ORIGINAL["maybe_move_tensor_to_cpu"]),
        lambda: setattr(token_dispatcher, "maybe_move_tensor_to_cpu", cpu_compat._split_sizes_as_numpy), split_sizes),
    "schedule_plan_streams": (lambda: plan_torch(False), lambda: plan_torch(True), schedule_plan),
    "record_stream": (lambda: setattr(torch.Tensor, "record_stream", ORIGINAL["record_stream"]),
                      lambda: setattr(torch.Tensor, "record_stream", cpu_compat._record_stream), schedule_plan),
    "rope_cp_chunks": (
        lambda: setattr(rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", ORIGINAL["pos_emb_on_this_cp_rank"]),
        lambda: setattr(rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", cpu_compat.pos_emb_on_this_cp_rank),
        rope_on_cp_rank),
}


def attempt(run) -> str | None:
    """None if ``run`` ran, else its error in one line."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            run()
        return None
    except Exception as e:  # noqa: BLE001 -- the failure is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main():
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cpu_compat.apply()
    parallel_state.initialize_model_parallel(1, 1)
    random.model_parallel_cuda_manual_seed(1234)
    TRACKER.append(random.get_cuda_rng_tracker())
    report, control = {}, {}
    for name, (undo, redo, run) in SHIMS.items():
        control[name] = attempt(run)  # with every shim in place it must run
        undo()
        try:
            report[name] = attempt(run)
        finally:
            redo()
    print(json.dumps({"without": report, "control": control}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
