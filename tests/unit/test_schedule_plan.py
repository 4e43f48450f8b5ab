"""The split backward of megatron-core's schedule plan (model/schedule_plan.py) where it cannot split:
its exactness with local layers is the equivalence harness's (the overlap cases)."""
from types import SimpleNamespace

from megatron.chimera.model.schedule_plan import defer_weight_gradients


def test_with_transformer_engine_layers_a_plans_i_is_its_whole_backward():
    """Transformer Engine's fused linears compute a weight gradient in any backward: the plan's nodes are
    left alone (I is the whole backward) and W has nothing to run, so no weight gradient counts twice."""
    model = SimpleNamespace(config=SimpleNamespace(transformer_impl="transformer_engine"))
    weight_pass = defer_weight_gradients(plan=None, model=model)
    assert weight_pass.segments == [] and weight_pass.kept() == []
    weight_pass.run()
