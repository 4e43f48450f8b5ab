"""RankOrder names the ranks megatron-core's own rank generator puts in each group, in both of
Megatron-LM's orders (its default and --use-tp-pp-dp-mapping's), with and without context parallelism."""
import pytest
from megatron.core.parallel_state import RankGenerator

from megatron.chimera.distributed.rank_order import RankOrder


@pytest.mark.parametrize("pp_before_dp", [False, True])
@pytest.mark.parametrize("cp", [1, 2])
def test_rank_order_matches_megatron_cores_groups(pp_before_dp, cp):
    tp, dp, pp = 2, 3, 2
    order = RankOrder(tp, dp, pp, pp_before_dp, cp)
    theirs = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order.megatron_order)
    every = [(t, d, w, c) for t in range(tp) for d in range(dp) for w in range(pp) for c in range(cp)]
    ours = {"tp": [[order.rank(t, d, w, c) for t in range(tp)] for d in range(dp) for w in range(pp)
                   for c in range(cp)],
            "dp": [[order.rank(t, d, w, c) for d in range(dp)] for t in range(tp) for w in range(pp)
                   for c in range(cp)],
            "cp": [[order.rank(t, d, w, c) for c in range(cp)] for t in range(tp) for d in range(dp)
                   for w in range(pp)],
            "dp-cp": [sorted(order.rank(t, d, w, c) for d in range(dp) for c in range(cp)) for t in range(tp)
                      for w in range(pp)],
            "pp": [[order.rank(t, d, w, c) for w in range(pp)] for t in range(tp) for d in range(dp)
                   for c in range(cp)]}
    for token, groups in ours.items():
        assert sorted(groups) == sorted(theirs.get_ranks(token)), f"{order.megatron_order}: {token} groups differ"
    world = tp * dp * pp * cp
    assert all(order.rank(*order.coords(r), order.cp_rank(r)) == r for r in range(world)), "coords does not invert rank"
    assert all(order.in_worker(t + tp * (c + cp * d), w) == order.rank(t, d, w, c) for t, d, w, c in every), \
        "in_worker indexes tp fastest, then cp, then dp"
    assert all(order.index_in_worker(order.in_worker(j, w)) == j for j in range(tp * cp * dp) for w in range(pp)), \
        "index_in_worker does not invert in_worker"
