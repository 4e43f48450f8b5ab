"""One micro-batch's backward through a stage, split in two passes over its autograd graph.

I (``backward_input``) computes the gradient of the stage's input, which the previous stage waits
for, and nothing else (but a weight used at two nested places, ``_nested_shares``): torch computes
only the gradients a pass asks for, so a matrix multiply on the input's path skips its
weight-gradient product. Before each node that also feeds a parameter runs,
a hook keeps the gradient it receives.

W (``WeightPass.run``) restarts the backward from each such node with the kept gradient, restricted
to the parameters below it that the input's path does not reach: the weight-gradient products and
nothing else. Gradients land in ``param.grad`` through torch's own accumulation, so gradient hooks
(mixed precision, the distributed optimizer's buffers) see them exactly as after a whole backward.

The graph, and so every activation of the micro-batch, is kept from I until W ends.

Layers that split their own backward (Transformer Engine's with ``delay_wgrad_compute``: the backward
queues their weight-gradient GEMMs, ``backward_dw()`` runs them) mark their parameters with that call
(``param.delayed_wgrad``). Then I is the whole backward, which frees the graph, and W is the calls.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node:
    """A tensor's place in the graph: its grad_fn, or for a leaf its gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _input_path(root: Node, boundary: Node) -> set[Node]:
    """Nodes from which the boundary (the stage input) is reachable: the input gradient's path."""
    parents: dict[Node, list[Node]] = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for child in _children(node):
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    on_path, stack = {boundary}, [boundary]
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in on_path:
                on_path.add(parent)
                stack.append(parent)
    return on_path


def _params_below(node: Node, on_path: set[Node], accumulators: dict[Node, torch.Tensor]) -> list:
    """Parameters reachable from ``node`` without entering the input's path."""
    found, seen, stack = [], set(), [c for c in _children(node) if c not in on_path]
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        if child in accumulators:
            found.append(accumulators[child])
        stack.extend(c for c in _children(child) if c not in on_path)
    return found


@dataclass
class _Restart:
    node: Node
    params: list
    grads: dict  # output number -> the gradient the node received there in I


class WeightPass:
    """The W half of one micro-batch's backward through one stage copy: restarts of its graph, or the
    delayed weight-gradient calls of its layers (each with its parameters), run last layer first."""

    def __init__(self, restarts: list[_Restart], delayed: list[tuple[Callable[[], None], list]] = ()):
        self.restarts, self.delayed = restarts, list(delayed)

    def run(self) -> None:
        for r in self.restarts:
            edges = [(GradientEdge(r.node, i), g) for i, g in r.grads.items() if g is not None]
            if edges:
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], retain_graph=True,
                                        inputs=r.params)
        for compute, params in reversed(self.delayed):
            _accumulate_delayed(compute, params)
        self.restarts, self.delayed = [], []  # frees the graph and the kept gradients

    def kept(self) -> list[torch.Tensor]:
        """The gradients kept for the restarts (what an observer counts as held for W)."""
        return [g for r in self.restarts for g in r.grads.values() if g is not None]


def _delayed(params: list[torch.Tensor]) -> list[tuple[Callable[[], None], list]]:
    """The parameters' delayed weight-gradient calls, each with the parameters it computes, in the order
    of the parameters (the chunk's: its layers')."""
    calls: dict = {}
    for p in params:
        compute = getattr(p, "delayed_wgrad", None)
        if compute is not None:
            calls.setdefault(compute, []).append(p)
    return list(calls.items())


def _accumulate_delayed(compute: Callable[[], None], params: list) -> None:
    """Run one delayed weight-gradient call and hand what it leaves in ``.grad`` to torch's own accumulation
    (a leaf's backward), so that it adds to the gradient and runs its hooks as a whole backward would.
    Transformer Engine assigns ``.grad`` instead (2.3 to 2.7: only an empty one) and runs no hooks; what it
    adds into ``main_grad`` itself (gradient-accumulation fusion) needs nothing more."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    compute()
    fresh = [(p, p.grad) for p in params if p.grad is not None]
    for p, grad in zip(params, held):
        p.grad = grad
    if fresh:
        torch.autograd.backward([p for p, _ in fresh], [g for _, g in fresh])


def graph_root(output: torch.Tensor):
    """Where a backward from ``output`` starts: its node's edge, so the gradient is checked against the
    shape the node produced, not the output's data, which the executor releases once it is sent."""
    return GradientEdge(output.grad_fn, output.output_nr) if output.grad_fn is not None else output


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, boundary: torch.Tensor | None,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor | None, WeightPass]:
    """I: the gradient of ``boundary`` (the stage input, or the first stage's embedding output), and
    the W pass that completes the backward. ``grad`` is None for a loss. Without a boundary (a first
    stage whose embedding was not found) nothing is sent upstream and W runs the whole backward. Where
    parameters carry ``delayed_wgrad``, I is the whole backward and W their delayed calls."""
    if grad is None:
        grad = torch.ones_like(output)
    delayed = _delayed(params)
    if delayed:
        return _whole_backward(output, grad, boundary, params), WeightPass([], delayed)
    if boundary is None:
        return None, WeightPass([_Restart(output.grad_fn, params, {output.output_nr: grad})])
    root, start = output.grad_fn, _node(boundary)
    accumulators = {_node(p): p for p in params if p.requires_grad}
    on_path = _input_path(root, start)
    restarts, handles = [], []
    for node in on_path:
        below = _params_below(node, on_path, accumulators)
        if below:
            restart = _Restart(node, below, {})
            restarts.append(restart)
            if node is not start:
                handles.append(node.register_prehook(lambda grads, r=restart: r.grads.update(enumerate(grads))))
    eager = _nested_shares(restarts, on_path)
    try:
        dx = _input_gradient(output, grad, boundary, eager)
    finally:
        for h in handles:
            h.remove()
    for r in restarts:
        if r.node is start:  # the boundary's own node does not run in I: what it receives is dx
            r.grads[boundary.output_nr] = dx
    return dx, WeightPass(restarts)


def _whole_backward(output: torch.Tensor, grad: torch.Tensor, boundary: torch.Tensor | None,
                    params: list) -> torch.Tensor | None:
    """I where the layers delay their own weight gradients: the whole backward, every other gradient
    accumulated as usual; the boundary's gradient (None without a boundary)."""
    if boundary is None:
        torch.autograd.backward(graph_root(output), grad, inputs=params)
        return None
    held, boundary.grad = boundary.grad, None
    torch.autograd.backward(graph_root(output), grad, inputs=[boundary, *params])
    dx, boundary.grad = boundary.grad, held
    return dx


def _input_gradient(output: torch.Tensor, grad: torch.Tensor, boundary: torch.Tensor, eager: list) -> torch.Tensor:
    """The boundary's gradient, and with it the ``eager`` parameters' (accumulated into ``.grad`` by torch,
    so their gradient hooks run as after a whole backward)."""
    if not eager:
        (dx,) = torch.autograd.grad(graph_root(output), boundary, grad, retain_graph=True)
        return dx
    held, boundary.grad = boundary.grad, None
    torch.autograd.backward(graph_root(output), grad, retain_graph=True, inputs=[boundary, *eager])
    dx, boundary.grad = boundary.grad, held
    return dx


def _nested_shares(restarts: list[_Restart], on_path: set[Node]) -> list:
    """Parameters below two restart points one of which lies below the other: megatron-core's output
    layer computes both the main logits and, below them, the multi-token-prediction logits. A restart
    from the upper point would reach the parameter again through the lower one (and re-run the backward
    of the loss in between, which megatron-core's cross entropy does not allow twice), so these are
    taken out of both restarts and computed in I. Parameters below two points neither of which lies
    below the other stay in both: each restart adds its own use's share. Restarts left without
    parameters are dropped (in place)."""
    owners: dict[int, list[_Restart]] = {}
    nested = {}
    for r in restarts:
        for p in r.params:
            earlier = owners.setdefault(id(p), [])
            if any(_below(o.node, r.node, on_path) or _below(r.node, o.node, on_path) for o in earlier):
                nested[id(p)] = p
            earlier.append(r)
    for r in restarts:
        r.params = [p for p in r.params if id(p) not in nested]
    restarts[:] = [r for r in restarts if r.params]
    return list(nested.values())


def _below(top: Node, node: Node, on_path: set[Node]) -> bool:
    """Whether ``node`` is reached from ``top`` along the input's path."""
    seen, stack = set(), [top]
    while stack:
        current = stack.pop()
        for child in _children(current):
            if child is node:
                return True
            if child in on_path and child not in seen:
                seen.add(child)
                stack.append(child)
    return False
