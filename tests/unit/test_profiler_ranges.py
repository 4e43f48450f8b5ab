"""Profiler ranges on every action, and faults placed in the lowered list, in one process.

With a stand-in transport (a receive gets zeros at once), the executor runs every kind of action (F,
B, I, W, sends, receives, all-reduces) under the profiler, one ``PP:`` range each in list order; a
PipelineFault's message shows the list around where the worker was, and says whose fault it was: a
forward's own error or a communication call's.
"""
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from chimera_schedules import build
from chimera_schedules.ir.actions import Op
from chimera_schedules.passes.lowering import lower
from chimera_schedules.runtime.executor import make_forward_backward
from chimera_schedules.runtime.faults import ComputeFault, PipelineFault
from chimera_schedules.runtime.messages import Transport


def pp_ranges(events) -> list[str]:
    """The names of a trace's ``PP:`` ranges, in the order they started."""
    return [e["name"] for e in sorted(events, key=lambda e: e["ts"]) if e.get("name", "").startswith("PP:")]


HIDDEN, SEQ = 4, 3


class Chunk(torch.nn.Module):
    """A model chunk as the executor sees one: megatron-core's config fields and set_input_tensor."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(sequence_parallel=False, tensor_model_parallel_size=1, hidden_size=HIDDEN)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.input = None

    def set_input_tensor(self, x):
        self.input = x

    def forward(self, batch):
        return self.linear(batch if self.input is None else self.input)


def forward_step(data, chunk):
    """megatron-core's forward_step_func: a first stage reads a micro-batch, the others their input."""
    return chunk(next(data) if data is not None else None), lambda out: (out.square().sum(), {"loss": out.sum()})


class StandInPeer:
    """The other worker: a receive gets zeros at once. Waiting for the ``broken`` receive or send (by
    its order among receives or sends) fails as a dead peer does; ``slow_sends`` keeps sends in flight
    until the flush."""

    def __init__(self, broken: tuple[str, int] | None = None, slow_sends: bool = False):
        self.broken, self.slow_sends, self.posted = broken, slow_sends, defaultdict(int)

    def _post(self, kind: str) -> tuple[str, int]:
        self.posted[kind] += 1
        return kind, self.posted[kind] - 1

    def irecv(self, tensor, rank, group):
        tensor.zero_()
        return self._post("recv")

    def isend(self, tensor, rank, group):
        return self._post("send")

    def wait(self, work) -> None:
        if work == self.broken:
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500\nmore detail")

    def done(self, work) -> bool:
        return not (self.slow_sends and work[0] == "send")


class NoSync:
    def start(self, pipeline, stage, group, channel) -> None:
        pass

    def finish(self) -> None:
        pass


LOWERED = lower(build("dualpipe", 2, 4))  # worker 0 runs F, B, I, W, sends, receives and all-reduces


def worker0(peer: StandInPeer):
    """Worker 0's forward_backward over ``peer``, and the arguments of one call."""
    transport = Transport(0, [0, 1], defaultdict(lambda: None), torch.device("cpu"), torch.float32, peer)
    held = LOWERED.held(0)
    chunks = [Chunk() for _ in held]
    data = [iter([torch.randn(SEQ, 1, HIDDEN) for _ in range(LOWERED.microbatches)]) if stage == 0 else None
            for _, stage in held]
    call = dict(forward_step_func=forward_step, data_iterator=data, model=chunks,
                num_microbatches=LOWERED.microbatches, seq_length=SEQ, micro_batch_size=1)
    return make_forward_backward(LOWERED, transport, NoSync()), call


def test_every_action_run_in_one_process_has_exactly_one_range_in_list_order():
    actions = LOWERED.workers[0]
    assert {a.op for a in actions} == {Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.SEND,
                                       Op.RECV, Op.ALLREDUCE}
    forward_backward, call = worker0(StandInPeer())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward(**call)
    assert pp_ranges({"name": e.name, "ts": e.time_range.start} for e in prof.events()) == \
        [f"PP:{a}" for a in actions]


def test_a_fault_shows_the_lowered_list_around_the_action_the_worker_was_at(one_process_group):
    """The first receive (rA2p1s1<1@up, action 2) fails when F2p1s1 (action 3) waits for it."""
    forward_backward, call = worker0(StandInPeer(broken=("recv", 0)))
    with pytest.raises(PipelineFault) as fault:
        forward_backward(**call)
    lines = str(fault.value).splitlines()
    assert lines[0] == ("rank 0 (worker 0) waited for the activation of micro-batch 2, pipeline 1, stage 1 from "
                        "worker 1 (rank 1) on group up for F2p1s1: [gloo] Connection closed by peer [127.0.0.1]:29500")
    assert lines[1:] == ["the worker's lowered list (19 actions), at action 3:",
                         "    0 F0p0s0", "    1 sA0p0s1>1@down", "    2 rA2p1s1<1@up", ">>  3 F2p1s1",
                         "    4 F1p0s0", "    5 sA1p0s1>1@down", "    6 rA3p1s1<1@up"]
    assert fault.value.headline == lines[0] and str(fault.value.action) == "rA2p1s1<1@up"


def test_a_send_that_fails_at_the_flush_is_marked_in_the_list(one_process_group):
    forward_backward, call = worker0(StandInPeer(broken=("send", 0), slow_sends=True))
    with pytest.raises(PipelineFault) as fault:
        forward_backward(**call)
    lines = str(fault.value).splitlines()
    assert lines[0].startswith("rank 0 (worker 0) could not deliver the activation of micro-batch 0, pipeline 0, "
                               "stage 1 to worker 1")
    assert lines[1] == "the worker's lowered list (19 actions), at the flush, waiting for action 1:"
    assert lines[2:] == ["    0 F0p0s0", ">>  1 sA0p0s1>1@down", "    2 rA2p1s1<1@up", "    3 F2p1s1", "    4 F1p0s0"]


def test_a_forward_that_raises_is_a_compute_fault_naming_the_action(one_process_group):
    """Not a communication call's failure: a ComputeFault, this worker's own, naming the action it was
    at (F2p1s1, action 3, the first forward of a stage 1) and keeping the original as its cause."""
    forward_backward, call = worker0(StandInPeer())

    def raising(data, chunk):
        if chunk.input is not None:
            raise ValueError("a bug in the forward\nmore detail")
        return forward_step(data, chunk)

    with pytest.raises(ComputeFault) as fault:
        forward_backward(**call | {"forward_step_func": raising})
    lines = str(fault.value).splitlines()
    assert lines[0] == ("rank 0 (worker 0): the forward of micro-batch 2, pipeline 1, stage 1 (F2p1s1) raised "
                        "ValueError: a bug in the forward"), lines[0]
    assert lines[1] == "the worker's lowered list (19 actions), at action 3:", lines[1]
    assert isinstance(fault.value.__cause__, ValueError) and "in raising" in fault.value.trace(), fault.value.trace()


class PostingFails(StandInPeer):
    """Posting a receive fails with torch.distributed's own error, as NCCL's do."""

    def irecv(self, tensor, rank, group):
        raise dist.DistError("NCCL error: remote process exited\nmore detail")


def test_a_post_that_fails_with_a_distributed_error_is_a_collective_failure(one_process_group):
    forward_backward, call = worker0(PostingFails())
    with pytest.raises(PipelineFault) as fault:
        forward_backward(**call)
    assert not isinstance(fault.value, ComputeFault), str(fault.value)
    headline = fault.value.headline
    assert headline == ("rank 0 (worker 0): a collective failed in posting the receive of the activation of "
                        "micro-batch 2, pipeline 1, stage 1 from worker 1 (rank 1) on group up for F2p1s1: NCCL error: "
                        "remote process exited"), headline
    assert str(fault.value).splitlines()[1] == "the worker's lowered list (19 actions), at action 2:", str(fault.value)
