"""Where a (tensor-parallel rank, data-parallel rank, pipeline worker, context-parallel rank) coordinate
lives in the world.

megatron-core numbers ranks tp fastest, then cp, then dp, then pp by default (its order "tp-cp-ep-dp-pp");
under Megatron-LM's --use-tp-pp-dp-mapping tp, then cp, then pp, then dp ("tp-cp-ep-pp-dp"). Every group
process_groups.py builds goes through one ``RankOrder``, and megatron-core is initialised with the same
order (``megatron_order``), so its groups and ours name the same ranks (process_groups.py asserts it).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankOrder:
    tp: int
    dp: int
    pp: int
    pp_before_dp: bool = False  # --use-tp-pp-dp-mapping
    cp: int = 1

    @property
    def megatron_order(self) -> str:
        return "tp-cp-ep-pp-dp" if self.pp_before_dp else "tp-cp-ep-dp-pp"

    def rank(self, t: int, d: int, w: int, c: int = 0) -> int:
        outer = w + self.pp * d if self.pp_before_dp else d + self.dp * w
        return t + self.tp * (c + self.cp * outer)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tensor-parallel rank, data-parallel rank, pipeline worker) of a rank."""
        t, rest = rank % self.tp, rank // self.tp // self.cp
        return (t, rest // self.pp, rest % self.pp) if self.pp_before_dp else (t, rest % self.dp, rest // self.dp)

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp % self.cp

    def in_worker(self, j: int, w: int) -> int:
        """The rank of pipeline worker ``w``'s j-th TP x CP x DP rank (j = tp rank + TP x (cp rank + CP x dp
        rank): the index megatron-core's expert groups count in within one worker)."""
        rest = j // self.tp
        return self.rank(j % self.tp, rest // self.cp, w, rest % self.cp)

    def index_in_worker(self, rank: int) -> int:
        """``in_worker``'s j of a rank."""
        t, d, _ = self.coords(rank)
        return t + self.tp * (self.cp_rank(rank) + self.cp * d)
