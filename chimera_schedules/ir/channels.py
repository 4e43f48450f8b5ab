"""Channel names: the process group each lowered communication action names.

- ``down`` carries every message from a worker to a higher one, ``up`` every message to a lower one,
  whatever its pipeline or kind. Each group then carries one direction per pair of workers, so a
  message never waits on NCCL's per-pair stream (NCCL_MODEL.md rule 1) behind one going the other
  way, and each neighbour pair costs two p2p communicators, not one per pipeline and kind: Chimera's
  down-pipeline activations share ``down`` with its up-pipeline gradients (4 communicators per
  interior rank instead of 8). Both ends post a channel's messages in one global order (lowering).
- ``stage{S}`` is model stage S's replica group (every copy, every data-parallel rank).
- ``experts{S}`` is stage S's expert replica group (expert parallelism: every copy of the same experts),
  ``embedding`` the word embedding's group (every copy of a tied embedding): lowering names them only
  when asked to post those reductions in the lists (``lower``'s ``experts`` and ``embedding_stages``).
Lowering names them; the trainer creates a process group for each.
"""

P2P_GROUPS = ("down", "up")


def p2p_group(src: int, dst: int) -> str:
    """The channel of a message from worker ``src`` to worker ``dst``."""
    return P2P_GROUPS[0] if dst > src else P2P_GROUPS[1]


def stage_group(stage: int) -> str:
    return f"stage{stage}"


EMBEDDING_GROUP = "embedding"
EMBEDDING_META = "embedding_stages"  # a lowered schedule's meta: the stages whose copies ``embedding`` sums


def expert_group(stage: int) -> str:
    return f"experts{stage}"


def reduces(group: str) -> str:
    """What an all-reduce on collective group ``group`` sums: "stage" (a stage copy's gradients),
    "experts" (a stage's routed experts) or "embedding" (the tied word embedding's copies)."""
    if group == EMBEDDING_GROUP:
        return "embedding"
    return "experts" if group.startswith("experts") else "stage"
