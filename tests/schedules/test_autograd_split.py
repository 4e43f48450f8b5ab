"""I and W of one micro-batch (autograd_split.py) give exactly the whole backward's gradients: I only
the stage input's, W then every parameter's, through torch's own accumulation (so gradient hooks fire)."""
import pytest
import torch

from chimera_schedules.runtime.autograd_split import backward_input


class Stage(torch.nn.Module):
    """A first stage (token ids in, its embedding output the boundary) or a later one (activations in)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 8)
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)

    def forward(self, x=None, ids=None):
        if ids is not None:
            x = self.boundary = self.embedding(ids) * 2.0
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) + x  # the input reaches the output twice


@pytest.mark.parametrize("first", [False, True])
def test_input_then_weight_pass_equals_a_whole_backward(first):
    torch.manual_seed(0)
    stage = Stage()
    params = list(stage.parameters())
    x, ids = torch.randn(4, 8, requires_grad=True), torch.randint(0, 10, (4,))

    def run():
        return stage(x, ids) if first else stage(x)

    grad = torch.randn(4, 8)
    run().backward(grad)
    whole = [None if p.grad is None else p.grad.clone() for p in params]
    whole_input = x.grad.clone() if not first else None
    stage.zero_grad(set_to_none=True)

    accumulated = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(p))
    out = run()
    dx, weight_pass = backward_input(out, grad, stage.boundary if first else x, params)
    assert all(p.grad is None for p in params) and not accumulated  # I computes no parameter gradient
    if not first:
        assert torch.equal(dx, whole_input)
    weight_pass.run()
    for p, g in zip(params, whole):
        assert (p.grad is None) == (g is None)
        if g is not None:
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
    assert len(accumulated) == sum(g is not None for g in whole)


def test_without_a_boundary_w_runs_the_whole_backward():
    torch.manual_seed(0)
    stage = Stage()
    loss = stage(ids=torch.randint(0, 10, (4,))).sum()
    dx, weight_pass = backward_input(loss, None, None, list(stage.parameters()))
    assert dx is None and stage.fc1.weight.grad is None
    weight_pass.run()
    assert stage.embedding.weight.grad is not None and stage.fc1.weight.grad is not None
