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

from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from megatron.core.pipeline_parallel.utils import ScheduleNode, set_streams
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from .sequence_halves import SequenceHalves


def build(model, *args, **kwargs):
    """``model.build_schedule_plan(*args, **kwargs)``, with megatron-core's communication stream made
    (``set_streams``: on the CPU, cpu_compat's stand-in) and the plan given ``defer_weight_gradients``,
    which the executor calls before a backward that is an I, and ``run_halves`` (stage.SchedulePlan's
    protocol), with the stage input the chunk was given (read again when the plan's forward starts)."""
    set_streams(high_priority=model.config.high_priority_a2a_comm_stream)
    plan = model.build_schedule_plan(*args, **kwargs)
    plan.defer_weight_gradients = partial(defer_weight_gradients, plan, model)
    plan.run_halves = partial(run_halves, plan)
    chunk = plan.state.model  # the GPTModel itself, ``model`` perhaps a wrapper
    plan.stage_input = None if chunk.pre_process else chunk.decoder.input_tensor
    return plan


class PlanWeightPass:
    """W of one micro-batch's backward through a plan run as I: each node's segment again, restricted
    to the chunk's parameters, in the order I ran them."""

    def __init__(self, params: list[torch.Tensor]):
        self.params, self.segments = params, []
        self.aux_loss_share = 1.0  # a half's (run_halves): its auxiliary losses' gradients at this share

    def keep(self, tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.segments.append((tensors, grads))

    def run(self) -> None:
        with _aux_losses_at(self.aux_loss_share):
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
    weight_pass = plan.weight_pass = PlanWeightPass([p for p in model.parameters() if p.requires_grad])
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
    for later ones (the residual, the dispatched probabilities, a shared expert's output), the stage
    input a later stage's chunk was given (the pre-process node's output there), and in a sequence's
    second half the first half's keys and values it attended to (``sequence_halves.py``)."""
    found = [plan.state.decoder_input, *getattr(plan, "prefix_leaves", ())]
    for node in nodes:
        found += list(node.inputs or ()) + list(getattr(node, "detached", ()))
    unique = {id(t): t for t in found if t is not None and t.requires_grad and t.grad_fn is None}
    return list(unique.values())


def run_halves(first, second, grads: tuple | None = None):
    """stage.SchedulePlan.run_halves: ``first`` and ``second``, two plans of one chunk (a micro-batch's two
    halves), run interleaved: their forwards, returning both outputs, or with ``grads`` their backwards.
    The halves of a sequence (the chunk has ``sequence_halves``) run their backwards second half first:
    its attention gives the first half's keys and values their gradients."""
    plans = (first, second)
    halves = _sequence_halves(first)
    if grads is None:
        with _tracked_as_mean():
            return _forward_halves(plans, halves)
    share = _aux_loss_share(first)
    for plan in plans:
        if getattr(plan, "weight_pass", None) is not None:  # an I: its W runs the same segments again
            plan.weight_pass.aux_loss_share = share
    with _aux_losses_at(share):
        if halves is None:
            _backward_halves(plans, list(grads))
        else:
            _backward_halves(plans[::-1], list(grads[::-1]))
    return None


def _sequence_halves(plan) -> SequenceHalves | None:
    """The chunk's state for halves of a sequence (sequence_halves.py), None where it runs batch halves."""
    return getattr(plan.state.model, "sequence_halves", None)


def _forward_halves(plans: tuple, halves: SequenceHalves | None) -> tuple:
    """megatron-core's forward (TransformerModelChunkSchedulePlan.run without a backward) for two plans,
    each layer's parts in the halves order."""
    outputs = []
    for k, plan in enumerate(plans):
        model = plan.state.model
        if not model.pre_process:
            model.set_input_tensor(plan.stage_input)  # the pre-process node reads the chunk's input now
        plan.record_current_stream()
        with _running(halves, k):
            outputs.append(plan.pre_process.forward())
    for i in range(plans[0].num_layers()):
        layers = [plan.get_layer(i) for plan in plans]
        outputs = _forward_layer(layers, outputs, halves)
        if halves is not None:
            _link_prefixes(halves.take_prefixes(), layers[0].pre_dispatch_computation, plans[1])
    outputs = [plan.post_process.forward(x) if plan.post_process is not None else x for plan, x in zip(plans, outputs)]
    for plan in plans:
        plan.wait_current_stream()
    return tuple(outputs)


def _forward_layer(layers: list, xs: list, halves: SequenceHalves | None) -> list:
    """One layer of both halves (TransformerLayerSchedulePlan.run's forward calls): attention and dispatch
    of half a, of half b, then experts and combine of a, of b; each half's dispatcher state its own."""
    kept = [None] * len(layers)
    for names in (("pre_dispatch_computation", "moe_dispatch"), ("mlp", "moe_combine")):
        for k, layer in enumerate(layers):
            with _own_dispatcher(layer, kept, k), layer.get_low_precision_context(), _running(halves, k):
                for name in names:
                    xs[k] = getattr(layer, name).forward(xs[k])
    for k, layer in enumerate(layers):
        with layer.get_low_precision_context():
            xs[k] = layer.mtp_post_process.forward(xs[k])
    return xs


def _running(halves: SequenceHalves | None, k: int):
    """Half ``k`` of a sequence running inside (nothing to say for batch halves)."""
    return halves.half(k) if halves is not None else nullcontext()


def _link_prefixes(prefixes: list, first_attention, second) -> None:
    """The first half's keys and values that the second half's attention read as leaves: the first half's
    attention node backpropagates each leaf's gradient into its tensor (``TransformerLayerNode``'s
    ``before_detached``/``detached`` pairs), and the second half's I computes the leaves' gradients."""
    if not prefixes:
        return
    tensors, leaves = zip(*prefixes)
    first_attention.before_detached += tensors
    first_attention.detached += leaves
    second.prefix_leaves = [*getattr(second, "prefix_leaves", ()), *leaves]


def _backward_halves(plans: tuple, grads: list) -> None:
    """megatron-core's backward (TransformerModelChunkSchedulePlan.run without a forward) for two plans,
    each layer's parts in the halves order; each plan's input gets its gradient, its state is released."""
    for plan in plans:
        plan.record_current_stream()
    grads = [plan.post_process.backward(g) if plan.post_process is not None else g for plan, g in zip(plans, grads)]
    for _ in range(plans[0].num_layers()):
        layers = [plan.pop_layer() for plan in plans]
        grads = _backward_layer(layers, grads)
        for layer in layers:
            layer.release_state()
    for plan, grad in zip(plans, grads):
        plan.pre_process.backward(grad)
        plan.wait_current_stream()
        plan.release_state()


def _backward_layer(layers: list, grads: list) -> list:
    """One layer of both halves backwards (TransformerLayerSchedulePlan.run's backward calls): combine and
    experts of half a, of half b, then dispatch and attention of a, of b; each compute part's weight
    gradients right after it."""
    for k, layer in enumerate(layers):
        grads[k] = layer.mtp_post_process.backward(grads[k])
    for k, layer in enumerate(layers):
        grads[k] = layer.mlp.backward(layer.moe_combine.backward(grads[k]))
        layer.mlp.backward_dw()
    for k, layer in enumerate(layers):
        grads[k] = layer.pre_dispatch_computation.backward(layer.moe_dispatch.backward(grads[k]))
        layer.pre_dispatch_computation.backward_dw()
    return grads


@contextmanager
def _own_dispatcher(layer, kept: list, k: int):
    """Half ``k``'s state of the layer's token dispatcher around its parts: megatron-core's alltoall
    dispatcher keeps one micro-batch's routing (splits, permutation maps) on itself from the dispatch
    preprocessing to the combine, and the other half's parts run between. Restored from ``kept[k]`` when
    the half has run a part before, kept after. A multi-token-prediction layer's dispatcher is its inner
    transformer layer's."""
    dispatcher = next((m.token_dispatcher for m in layer.layer.modules() if hasattr(m, "token_dispatcher")), None)
    if dispatcher is None:
        yield
        return
    state = vars(dispatcher)
    if kept[k] is not None:
        state.clear()
        state.update(kept[k])
    yield
    kept[k] = dict(state)


def _aux_loss_share(plan) -> float:
    """The share of each half's auxiliary losses in the whole micro-batch's: a half's z-loss and
    seq_aux_loss are means over its tokens or sequences (half the whole's), weighed by their tokens
    instead with --calculate-per-token-loss (the halves' sum is the whole's)."""
    return 1.0 if plan.state.model.config.calculate_per_token_loss else 0.5


@contextmanager
def _aux_losses_at(share: float):
    """MoEAuxLossAutoScaler's scale (the trainer's, moe.scale_auxiliary_losses) times ``share`` inside,
    restored after (set_loss_scale copies into the tensor it holds)."""
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    if share == 1.0 or scale is None:
        yield
        return
    kept = scale.clone()
    MoEAuxLossAutoScaler.set_loss_scale(kept * share)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale(kept)


@contextmanager
def _tracked_as_mean():
    """What two halves' routers add to megatron-core's metrics tracker (each the mean of its loss over
    its half), halved: the whole micro-batch's mean, as one forward would add it."""
    entries = get_moe_metrics_tracker().metrics
    before = {name: entry.values.clone() for name, entry in entries.items()}
    yield
    for name, entry in entries.items():
        added = entry.values - before[name] if name in before else entry.values.clone()
        entry.values.sub_(added / 2)
