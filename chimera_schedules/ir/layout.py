"""Which layers each model stage holds: Megatron-LM's pipeline layout, as a value.

A ``Layout`` lists the model stages in model order (stage 0 takes the tokens, the last one computes
the loss); which worker holds each stage is the schedule's placement, not the layout's. Each stage
holds some of ``E`` (the embedding), ``t`` (transformer layers, contiguous and in order), ``m``
(multi-token-prediction layers) and ``L`` (the output layer and the loss), as megatron-core's
``PipelineParallelLayerLayout`` spells them: ``Et|tt|tt|ttmL``, with ``(tt|)*3`` for repeats.

The constructors are the ways Megatron-LM users ask for one: the even split, the first and last
stages' layer counts (``--decoder-first/last-pipeline-num-layers``), the embedding and the loss
counted as a layer each (``--account-for-embedding/loss-in-pipeline-split``), and the string itself
(``--pipeline-model-parallel-layout``). Every rule raises ConfigError naming the flag.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError, require

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
FIRST_FLAG, LAST_FLAG = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG, LOSS_FLAG = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"
MTP_FLAG = "--mtp-num-layers"
MAX_REPEAT = 10_000  # more stages or layers than any model has: a typo, not a layout


@dataclass(frozen=True)
class StageLayers:
    """One model stage: the embedding, ``layers`` transformer layers, ``mtp`` MTP layers, the loss."""
    embedding: bool = False
    layers: int = 0
    mtp: int = 0
    loss: bool = False

    def spelled(self) -> str:
        return "E" * self.embedding + "t" * self.layers + "m" * self.mtp + "L" * self.loss


@dataclass(frozen=True)
class Layout:
    stages: tuple[StageLayers, ...]

    @property
    def num_layers(self) -> int:
        return sum(s.layers for s in self.stages)

    @property
    def mtp_layers(self) -> int:
        return sum(s.mtp for s in self.stages)

    def first_layer(self, stage: int) -> int:
        """The model index of the stage's first transformer layer."""
        return sum(s.layers for s in self.stages[:stage])

    def layer_counts(self) -> tuple[int, ...]:
        return tuple(s.layers for s in self.stages)

    def chunk_slots(self) -> int:
        """The most layers one stage numbers, MTP included (megatron-core's per-layer metric slots)."""
        return max(s.layers + s.mtp for s in self.stages)

    def output_rows(self) -> tuple[int, ...]:
        """Per stage, how many activations' worth of sequence it sends on: 1, or after a stage of MTP
        layers without the loss, 1 + the MTP depths (megatron-core concatenates their hidden states)."""
        rows, out = 1, []
        for s in self.stages:
            rows += s.mtp
            out.append(1 if s.loss else rows)  # the loss stage sends nothing on
        return tuple(out)

    def embedding_stages(self, tied: bool) -> tuple[int, ...]:
        """The stages holding a copy of the word embedding, one each: the first, a stage of MTP layers
        (their embedding of the next tokens; the tied output layer beside it uses that copy), the last
        where the output layer shares it (``tied``). Their gradients are summed, as megatron-core's
        embedding group sums them."""
        last = len(self.stages) - 1
        held = {0} | {i for i, s in enumerate(self.stages) if s.mtp} | ({last} if tied else set())
        return tuple(sorted(held))

    def holds_last_layer(self, stage: int) -> bool:
        """Whether the stage holds the model's last transformer layer (the final norm follows it)."""
        return self.stages[stage].layers > 0 and self.first_layer(stage + 1) == self.num_layers

    def __str__(self) -> str:
        """Megatron-LM's string for it, runs of equal stages folded as ``(tt|)*n``: reusable with
        --pipeline-model-parallel-layout."""
        parts, spelled = [], [s.spelled() for s in self.stages]
        i = 0
        while i < len(spelled):
            j = i
            while j + 1 < len(spelled) - 1 and spelled[j + 1] == spelled[i]:
                j += 1
            run = j - i + 1
            last = j == len(spelled) - 1
            parts.append(f"({spelled[i]}|)*{run}" if run > 2 else "|".join(spelled[i:j + 1]) + ("" if last else "|"))
            i = j + 1
        return "".join(parts)

    def describe(self) -> str:
        """One line per stage, for logs: ``stage 0: embedding + layers 0-3``."""
        out = []
        for s, st in enumerate(self.stages):
            first = self.first_layer(s)
            held = (["embedding"] * st.embedding
                    + ([f"layers {first}-{first + st.layers - 1}" if st.layers > 1 else f"layer {first}"]
                       if st.layers else [])
                    + [f"{st.mtp} MTP"] * bool(st.mtp) + ["output layer and loss"] * st.loss)
            out.append(f"stage {s}: {' + '.join(held) or 'nothing'}")
        return "; ".join(out)


def even(num_layers: int, stages: int, mtp: int = 0) -> Layout:
    """Megatron-LM's default: ``num_layers / stages`` layers each, MTP with the loss on the last stage.
    Where the layers do not divide, the first stages take one more (the planner's nearest split)."""
    base, extra = divmod(num_layers, stages)
    return from_counts([base + (s < extra) for s in range(stages)], mtp)


def from_counts(counts, mtp: int = 0) -> Layout:
    """Transformer layers per stage; the embedding on the first, MTP and the loss on the last."""
    last = len(counts) - 1
    return Layout(tuple(StageLayers(s == 0, n, mtp if s == last else 0, s == last) for s, n in enumerate(counts)))


def megatron(num_layers: int, stages: int, mtp: int = 0, first: int | None = None, last: int | None = None,
             account_embedding: bool = False, account_loss: bool = False, per_rank: int = 1) -> Layout:
    """The split Megatron-LM's flags ask for. ``per_rank``: model stages per pipeline rank under
    megatron's round-robin placement (interleaved's v): first and last then count a rank's layers,
    spread evenly over its v stages, as megatron-core does; elsewhere they count the first and last
    model stages'."""
    if first is not None or last is not None:
        require(not (account_embedding or account_loss), FIRST_FLAG if first is not None else LAST_FLAG,
                first if first is not None else last, f"cannot be combined with {EMBEDDING_FLAG} or {LOSS_FLAG} "
                "(megatron-core's rule)")
        return _first_last(num_layers, stages, mtp, first, last, per_rank)
    slots = num_layers + account_embedding + account_loss
    if account_embedding or account_loss:
        flag = EMBEDDING_FLAG if account_embedding else LOSS_FLAG
        require(slots % stages == 0, flag, True, f"--num-layers ({num_layers}) plus the embedding and loss it "
                f"counts ({slots}) must divide into the {stages} pipeline stages")
    else:
        require(num_layers % stages == 0, "--num-layers", num_layers,
                f"must be divisible by the {stages} pipeline stages (or give {LAYOUT_FLAG})")
    per = slots // stages
    counts = [per] * stages
    counts[0] -= account_embedding
    counts[-1] -= account_loss
    return from_counts(counts, mtp)


def _first_last(num_layers: int, stages: int, mtp: int, first, last, per_rank: int) -> Layout:
    ranks = stages // per_rank
    for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        require(value is None or value >= 0, flag, value, "must not be negative")
        require(value is None or value % per_rank == 0, flag, value,
                f"must divide over the {per_rank} virtual stages of a pipeline rank")
    middle_ranks = ranks - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    flag, value = (FIRST_FLAG, first) if first is not None else (LAST_FLAG, last)
    require(rest >= 0, flag, value, f"leaves {rest} of --num-layers ({num_layers}) for the other stages")
    require(middle_ranks > 0 or rest == 0, flag, value,
            f"with no stage in between, the first and last must hold all {num_layers} layers")
    share = rest // (middle_ranks * per_rank) if middle_ranks else 0
    require(middle_ranks == 0 or rest % (middle_ranks * per_rank) == 0, flag, value,
            f"leaves {rest} layers, which the {middle_ranks * per_rank} other stages cannot share evenly")
    counts = []
    for s in range(stages):
        rank = s % ranks
        if rank == 0 and first is not None:
            counts.append(first // per_rank)
        elif rank == ranks - 1 and last is not None:
            counts.append(last // per_rank)
        else:
            counts.append(share)
    return from_counts(counts, mtp)


def parse(text: str) -> Layout:
    """A --pipeline-model-parallel-layout string: ``|`` between stages, ``(X)*n`` and ``x*n`` repeats,
    commas ignored, as megatron-core reads it."""
    flat = text.replace(",", "").replace(" ", "")
    require(all(int(n) <= MAX_REPEAT for n in re.findall(r"\*(\d+)", flat)), LAYOUT_FLAG, text,
            f"a repeat count above {MAX_REPEAT}")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"(.)\*(\d+)"):
        flat = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), flat)
    stages = []
    for part in flat.split("|"):
        bad = sorted(set(part) - set("EtmL"))
        require(not bad, LAYOUT_FLAG, text, f"unknown layer character {' '.join(map(repr, bad))} (the layout "
                "spells E, t, m and L, with | between stages and (...)*n or x*n for repeats)")
        require(re.fullmatch(r"E?t*m*L?", part) is not None, LAYOUT_FLAG, text,
                f"stage {len(stages)} reads {part!r}: within a stage, E, t, m and L come in that order")
        stages.append(StageLayers("E" in part, part.count("t"), part.count("m"), "L" in part))
    return Layout(tuple(stages))


def check(layout: Layout, num_layers: int, stages: int, mtp: int, text: str = "") -> None:
    """megatron-core's rules for a layout (``validate_layer_layout``) and ours: as many stages as the
    schedule has model stages, E first and L last once each, every layer, MTP after the last layer."""
    shown = text or str(layout)
    flat = "".join(s.spelled() for s in layout.stages)
    require(len(layout.stages) == stages, LAYOUT_FLAG, shown,
            f"has {len(layout.stages)} stages; this schedule runs {stages} model stages, so the layout needs "
            f"{stages} (one per model stage, in model order)")
    require(flat.count("E") == 1 and layout.stages[0].embedding, LAYOUT_FLAG, shown,
            "must start with the embedding E, once, on the first stage")
    require(flat.count("L") == 1 and layout.stages[-1].loss, LAYOUT_FLAG, shown,
            "must end with the loss L, once, on the last stage")
    require(layout.num_layers == num_layers, LAYOUT_FLAG, shown,
            f"holds {layout.num_layers} transformer layers t; --num-layers is {num_layers}")
    require(layout.mtp_layers == mtp, LAYOUT_FLAG if layout.mtp_layers else MTP_FLAG,
            shown if layout.mtp_layers else mtp, f"the layout holds {layout.mtp_layers} MTP layers m and "
            f"--mtp-num-layers is {mtp or 'not given'}")
    if mtp:
        require("t" not in flat[flat.index("m"):], LAYOUT_FLAG, shown, "an MTP layer m comes before a t: "
                "MTP layers follow the last transformer layer")
        require(sum(1 for s in layout.stages if s.mtp) == 1, LAYOUT_FLAG, shown,
                "all MTP layers must sit on one stage (megatron-core's rule)")


def from_flags(num_layers: int, stages: int, mtp: int = 0, text: str | None = None, first: int | None = None,
               last: int | None = None, account_embedding: bool = False, account_loss: bool = False,
               per_rank: int = 1) -> Layout:
    """The layout Megatron-LM's five flags ask for, checked."""
    if text is not None:
        for flag, given in ((FIRST_FLAG, first is not None), (LAST_FLAG, last is not None),
                            (EMBEDDING_FLAG, account_embedding), (LOSS_FLAG, account_loss)):
            require(not given, LAYOUT_FLAG, text, f"cannot be combined with {flag}: the layout says it all")
        layout = parse(text)
    else:
        layout = megatron(num_layers, stages, mtp, first, last, account_embedding, account_loss, per_rank)
    check(layout, num_layers, stages, mtp, text or "")
    return layout


__all__ = ["Layout", "StageLayers", "even", "from_counts", "megatron", "parse", "check", "from_flags", "ConfigError"]
