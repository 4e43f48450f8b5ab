"""Named states in Megatron-LM's layout of a checkpoint, without naming any: each at the place states.py's
``PLACES`` gives it, in the order their ``after`` declares (the optimizer's sharded state is built over the
model's, and its load, which may replace the fp32 main weights, comes after the model's, which copies the
model's weights into them). checkpointing.py says which parts a save or load keeps; this module builds what
megatron-core writes, the request a load fills, and hands each state its part of what was loaded.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from graphlib import TopologicalSorter

from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject

from .states import PLACES, Place, State


def ordered(states: Mapping[str, State], kept: Callable[[Place], bool] = lambda _: True) -> list[str]:
    """The names of ``states`` whose place ``kept`` keeps, each after the states its place comes ``after``."""
    unplaced = sorted(set(states) - set(PLACES))
    assert not unplaced, f"states.py's PLACES has no place for the states {unplaced}"
    order = TopologicalSorter({name: PLACES[name].after for name in states}).static_order()
    return [name for name in order if name in states and kept(PLACES[name])]


def at(tree: dict, key: str):
    """What ``tree`` holds at ``key`` ("a.b": nested; "": the whole tree); None when it holds nothing there."""
    for part in filter(None, key.split(".")):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def put(tree: dict, key: str, value: dict) -> None:
    """``value`` into ``tree`` at ``key`` (at "": its keys among the tree's own)."""
    if not key:
        tree.update(value)
        return
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _sharded(state: State, built: dict, after: tuple[str, ...], **metadata) -> dict:
    """A state's sharded state, given those of the sharded states it comes ``after`` (the optimizer: the model's)."""
    return state.sharded_state_dict(*(built[name] for name in after if name in built), **metadata)


def to_save(states: Mapping[str, State], names: list[str], checkpoint: dict) -> dict:
    """``checkpoint`` with the states ``names`` (in order) where Megatron-LM keeps them: megatron-core's sharded
    state of those sharded over ranks, the state dict of the others."""
    built = {}
    for name in names:
        state, place = states[name], PLACES[name]
        if hasattr(state, "sharded_state_dict"):
            value = built[name] = _sharded(state, built, place.after)
        else:
            value = state.state_dict()
        put(checkpoint, place.key, value)
    return checkpoint


def to_load(states: Mapping[str, State], names: list[str], common: dict) -> tuple[dict, set[str]]:
    """The request a load of the states ``names`` fills: their sharded states, each built with what the
    checkpoint's ``common`` state holds at its place, less their ShardedObjects (pickles: model chunks'
    ``_extra_state``, empty on the local spec, fp8 scales on Transformer Engine's, which we do not run), so a
    load unpickles nothing; and the keys of the ShardedObjects left out."""
    request, built = {}, {}
    for name in names:
        state, place = states[name], PLACES[name]
        if hasattr(state, "sharded_state_dict"):
            built[name] = _sharded(state, built, place.after, metadata=at(common, place.key) or {})
            put(request, place.key, built[name])
    objects, request = extract_matching_values(request, lambda v: isinstance(v, ShardedObject))
    return request, {obj.key for obj in nested_values(objects)}


def load_into(states: Mapping[str, State], names: list[str], loaded: dict) -> None:
    """Each of the states ``names``, in order, from what the ``loaded`` checkpoint holds at its place; one it
    holds nothing for (a loss scale or LR scheduler the checkpoint was saved without) stays as it is."""
    for name in names:
        value = at(loaded, PLACES[name].key)
        if value is not None:
            states[name].load_state_dict(value)
