"""RankOrder names the ranks megatron-core's own rank generator puts in each group, in both of
Megatron-LM's orders (its default and --use-tp-pp-dp-mapping's)."""
import pytest
from megatron.core.parallel_state import RankGenerator

from megatron.chimera.distributed.rank_order import RankOrder


@pytest.mark.parametrize("pp_before_dp", [False, True])
def test_rank_order_matches_megatron_cores_groups(pp_before_dp):
    tp, dp, pp = 2, 3, 2
    order = RankOrder(tp, dp, pp, pp_before_dp)
    theirs = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order.megatron_order)
    ours = {"tp": [[order.rank(t, d, w) for t in range(tp)] for d in range(dp) for w in range(pp)],
            "dp": [[order.rank(t, d, w) for d in range(dp)] for t in range(tp) for w in range(pp)],
            "pp": [[order.rank(t, d, w) for w in range(pp)] for t in range(tp) for d in range(dp)]}
    for token, groups in ours.items():
        assert sorted(groups) == sorted(theirs.get_ranks(token)), f"{order.megatron_order}: {token} groups differ"
    assert all(order.rank(*order.coords(r)) == r for r in range(tp * dp * pp)), "coords does not invert rank"
    assert all(order.in_worker(t + tp * d, w) == order.rank(t, d, w)
               for t in range(tp) for d in range(dp) for w in range(pp)), "in_worker indexes tp fastest, then dp"
