"""A model chunk run in parts: megatron-core 0.19's schedule plan, for --overlap-moe-expert-parallel-comm.

``GPTModel.build_schedule_plan`` cuts each transformer layer into megatron-core's fine-grained callables
(attention, dispatch, experts, combine; ``chimera_schedules/ir/parts.py`` describes them), and
``TransformerModelChunkSchedulePlan.run(f_plan, b_plan, b_grad)`` runs one micro-batch's forward beside
another's backward, layer by layer, each all-to-all on the communication stream while the other
micro-batch computes. The executor runs every forward and backward of an overlapped schedule this way
(``chimera_schedules/runtime/stage.py``, ``PlanStage``), alone or paired.

What megatron-core's plan lacks is a split backward: it has no I and W. ``defer_weight_gradients`` gives
it one. Each node of a plan runs its backward on its own segment of the autograd graph (megatron-core
detaches the tensors between nodes). In I, each segment's backward asks only for the gradients of its
detached inputs, the tensors the next node up the backward needs, and keeps its graph; torch then skips
every weight-gradient product of local layers. W runs each kept segment's backward again, asking only
for the parameters: the weight gradients, accumulated into ``.grad`` by torch, hooks and all, exactly as
one whole backward would. The price is that W repeats the input-gradient products that lie between a
weight and its segment's output (within one node: attention, or the experts), and that every segment's
graph lives from I until W, as in ``runtime/autograd_split.py``. The post-process node (the output layer
and the loss) runs its whole backward in I: megatron-core's cross entropy works in place on what it
saved, so its backward cannot run twice; the output layer's weight gradient comes in I. Transformer
Engine's layers compute their weight gradients in any backward: with them I is the whole backward and W
has nothing left.
"""
from __future__ import annotations

from functools import partial

import torch
from megatron.core.pipeline_parallel.utils import ScheduleNode, set_streams


def build(model, *args, **kwargs):
    """``model.build_schedule_plan(*args, **kwargs)``, with megatron-core's communication stream made
    (``set_streams``: on the CPU, cpu_compat's stand-in) and the plan given ``defer_weight_gradients``,
    which the executor calls before a backward that is an I."""
    set_streams(high_priority=model.config.high_priority_a2a_comm_stream)
    plan = model.build_schedule_plan(*args, **kwargs)
    plan.defer_weight_gradients = partial(defer_weight_gradients, plan, model)
    return plan


class PlanWeightPass:
    """W of one micro-batch's backward through a plan run as I: each node's segment again, restricted
    to the chunk's parameters, in the order I ran them."""

    def __init__(self, params: list[torch.Tensor]):
        self.params, self.segments = params, []

    def keep(self, tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.segments.append((tensors, grads))

    def run(self) -> None:
        for tensors, grads in self.segments:
            torch.autograd.backward(tensors, grads, inputs=self.params)
        self.segments = []  # frees the graphs

    def kept(self) -> list[torch.Tensor]:
        """The output gradients kept for W (what an observer counts as held for W)."""
        return [g for _, grads in self.segments for g in grads]


def defer_weight_gradients(plan, model) -> PlanWeightPass:
    """Make the plan's next backward an I (every node computes only its inputs' gradients, keeping its
    graph); returns the W that completes it. Call after the plan's forward, before its backward. With
    Transformer Engine's layers the I stays the whole backward and the W has nothing to do: their fused
    linears compute a weight gradient whatever autograd asks for (and with gradient-accumulation fusion
    add it into ``main_grad`` there), so a W that ran the nodes again would add it twice."""
    if model.config.transformer_impl == "transformer_engine":
        return PlanWeightPass([])
    weight_pass = PlanWeightPass([p for p in model.parameters() if p.requires_grad])
    nodes = [n for n in _nodes(plan) if n is not plan.post_process]  # the loss's backward runs once: whole, in I
    leaves = _detached_leaves(plan, nodes)
    input_only = partial(_input_gradients, leaves, weight_pass)
    for node in nodes:
        node.default_backward_func = input_only  # what TransformerLayerNode.backward_impl calls
        if getattr(node.backward_func, "__func__", None) is type(node).default_backward_func:
            node.backward_func = input_only  # the pre- and post-process nodes bound it at construction
    return weight_pass


def _input_gradients(leaves: list[torch.Tensor], weight_pass: PlanWeightPass, outputs, output_grad):
    """A node's backward in I: the gradients of the detached tensors (its inputs, and what it detached for
    later nodes) and nothing else, its graph kept for W. megatron-core's ScheduleNode backward protocol:
    returns the output gradients it was given."""
    pairs = [(t, g) for t, g in zip(outputs, output_grad) if g is not None and t.requires_grad]
    if pairs:
        tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if leaves:
            torch.autograd.backward(tensors, grads, inputs=leaves, retain_graph=True)
        weight_pass.keep(tensors, grads)
    return output_grad


def _nodes(plan) -> list:
    """Every schedule node of the plan that runs a backward (no-op nodes excluded)."""
    layers = [plan.get_layer(i) for i in range(plan.num_layers())]
    slots = [getattr(layer, name) for layer in layers
             for name in ("pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine", "mtp_post_process")]
    return [n for n in [plan.pre_process, plan.post_process, *slots] if isinstance(n, ScheduleNode)]


def _detached_leaves(plan, nodes: list) -> list[torch.Tensor]:
    """The leaves whose gradients I computes: every node's detached inputs, the tensors nodes detached
    for later ones (the residual, the dispatched probabilities, a shared expert's output), and the stage
    input a later stage's chunk was given (the pre-process node's output there)."""
    found = [plan.state.decoder_input]
    for node in nodes:
        found += list(node.inputs or ()) + list(getattr(node, "detached", ()))
    unique = {id(t): t for t in found if t is not None and t.requires_grad and t.grad_fn is None}
    return list(unique.values())
