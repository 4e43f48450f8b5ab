"""Channel names: the process group each lowered communication action names.

- ``p{P}.act`` carries pipeline P's activations (to stage + 1), ``p{P}.grad`` its input gradients
  (to stage - 1): one group per direction and pipeline, so a large gradient never queues behind an
  activation on NCCL's per-pair stream (NCCL_MODEL.md rule 1);
- ``stage{S}`` is model stage S's replica group (every copy, every data-parallel rank).
Lowering names them; the trainer creates a process group for each.
"""


def act_group(pipeline: int) -> str:
    return f"p{pipeline}.act"


def grad_group(pipeline: int) -> str:
    return f"p{pipeline}.grad"


def stage_group(stage: int) -> str:
    return f"stage{stage}"


def message_group(kind: str, pipeline: int) -> str:
    """The channel of a message of ``kind`` ("act" or "grad")."""
    return act_group(pipeline) if kind == "act" else grad_group(pipeline)
