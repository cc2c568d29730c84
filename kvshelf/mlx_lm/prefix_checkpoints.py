"""Prefill that makes *prefix* checkpoints: mlx-lm's prompt prefill, stopped at every multiple of ``every`` tokens to
hand a copy of the state that cannot be cut to a callback (docs/CHECKPOINTS.md). These are checkpoints along a
prompt, stored with its session; checkpoints of an in-flight generation (docs/RESUMING.md) are another feature
(``resumable.py``, ``generation_checkpoint_writer.py``).

Why here and not in the store: which mlx-lm caches can be cut back (``KVCache``, ``QuantizedKVCache``: a cut is an
offset) and how to copy the ones that cannot (``ArraysCache``'s recurrent state, ``RotatingKVCache``'s ring — a ring
that has not wrapped yet may wrap before the prompt ends) is mlx-lm knowledge; the store saves any caches it is given
(``store.save(..., checkpoints={k: caches_at_k})``).

Speed: the steps are mlx-lm's own (``model(tokens[None], cache=cache)``, then ``mx.eval`` of every cache's state and
``mx.clear_cache()``, as ``generate_step`` does with ``prefill_step_size``); a step only ends early at a multiple of
``every`` (absolute positions: a restored cache of 1,024 tokens continues with its next checkpoint at 2,048). The
copy at a checkpoint is of the small state only — cuttable caches hand ``None`` and are cut from the final caches
when the checkpoints are saved (``checkpoint_caches``), so their bytes are the session's own chunks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..errors import InvalidCacheState

DEFAULT_EVERY = 1024
DEFAULT_STEP = 2048  # mlx-lm's generate_step prefill_step_size


def cuttable(cache: Any) -> bool:
    """A cache whose state at ``k`` tokens is a cut of its state at more (an offset): attention caches. A
    ``RotatingKVCache`` is not, even before it wraps: it may wrap before the prompt ends."""
    from mlx_lm.models.cache import RotatingKVCache

    trimmable = getattr(cache, "is_trimmable", None)
    return trimmable is not None and bool(trimmable()) and not isinstance(cache, RotatingKVCache) \
        and not hasattr(cache, "caches")


def _copied(value: Any) -> Any:
    if isinstance(value, mx.array):
        return mx.array(value)  # a new array: the live cache's slice assignments rebind its own, never this one
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    if hasattr(value, "__dict__") and hasattr(value, "is_trimmable"):  # a nested cache (CacheList)
        return copy_state(value)
    return value


def copy_state(cache: Any) -> Any:
    """A copy of ``cache`` that later updates of ``cache`` leave as it is (every array and list replaced)."""
    new = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(new, name, _copied(value))
    return new


def small_state(cache: Sequence[Any]) -> list[Any]:
    """Per layer: a copy of a cache that cannot be cut, None for one that can (cut later from the final caches)."""
    out = [None if cuttable(c) else copy_state(c) for c in cache]
    mx.eval([a for c in out if c is not None for a in _arrays(c)])
    return out


def _arrays(value: Any) -> list[mx.array]:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    if hasattr(value, "__dict__") and hasattr(value, "is_trimmable"):
        return [a for v in vars(value).values() for a in _arrays(v)]
    return []


def cut(cache: Any, k: int) -> Any:
    """A view of a cuttable ``cache`` holding its first ``k`` positions (the live cache is not changed)."""
    offset = int(getattr(cache, "offset", 0))
    if k > offset:
        raise InvalidCacheState(f"cannot cut a cache of {offset} positions to {k}")
    view = copy.copy(cache)
    view.trim(offset - k)
    return view


def checkpoint_caches(states: Sequence[Any], cache: Sequence[Any], k: int) -> list[Any]:
    """The whole caches at ``k``: the copies ``small_state`` made, and cuts of the final ``cache`` for the rest."""
    if len(states) != len(cache):
        raise InvalidCacheState(f"a checkpoint of {len(states)} layers for a cache of {len(cache)}")
    return [cut(c, k) if s is None else s for s, c in zip(states, cache)]


def prefill(model, tokens: Sequence[int] | mx.array, cache: Sequence[Any], *, every: int = DEFAULT_EVERY,
            on_checkpoint: Callable[[int, list[Any]], None] | None = None, step: int = DEFAULT_STEP,
            offset: int | None = None) -> int:
    """Run ``model`` over all of ``tokens`` into ``cache`` (which may already hold a prefix), in mlx-lm's prefill
    steps of at most ``step`` tokens that also end at every multiple of ``every`` absolute positions; at each such
    multiple ``k`` call ``on_checkpoint(k, small_state(cache))``. ``every=0`` makes no checkpoints (plain steps).
    Returns the cache offset reached. Like mlx-lm, the caller keeps the prompt's last token for the first decode
    step (pass ``prompt[:-1]``). ``offset``: the positions ``cache`` already holds, when no layer counts them
    (a model of recurrent layers only); by default the largest ``offset`` a layer reports."""
    if not isinstance(every, int) or every < 0:
        raise InvalidCacheState(f"every must be an int >= 0, got {every!r}")
    if not isinstance(step, int) or step < 1:
        raise InvalidCacheState(f"step must be a positive int, got {step!r}")
    toks = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
    n = int(toks.shape[0])
    start = _offset(cache) if offset is None else int(offset)
    i = 0
    while i < n:
        nxt = min(n, i + step)
        if every:
            nxt = min(nxt, ((start + i) // every + 1) * every - start)
        model(toks[i:nxt][None], cache=cache)
        mx.eval([c.state for c in cache])
        i = nxt
        if every and on_checkpoint is not None and (start + i) % every == 0:
            on_checkpoint(start + i, small_state(cache))
        mx.clear_cache()
    return start + n


def _offset(cache: Sequence[Any]) -> int:
    """Positions the caches already hold (0 for fresh ones): the largest offset any layer reports."""
    best = 0
    for c in cache:
        off = getattr(c, "offset", None)
        if isinstance(off, int):
            best = max(best, off)
    return best


class Collector:
    """``on_checkpoint`` that keeps the small states; ``for_store(cache)`` gives ``{k: caches_at_k}`` for
    ``store.save(..., checkpoints=...)`` once the prefill (and anything after it) is done."""

    def __init__(self):
        self.states: dict[int, list[Any]] = {}

    def __call__(self, k: int, states: list[Any]) -> None:
        self.states[k] = states

    def for_store(self, cache: Sequence[Any], length: int | None = None) -> dict[int, list[Any]]:
        """Checkpoints below ``length`` (default: every one strictly inside the cache's positions)."""
        limit = _offset(cache) if length is None else length
        return {k: checkpoint_caches(s, cache, k) for k, s in sorted(self.states.items()) if k < limit}


__all__ = ["Collector", "DEFAULT_EVERY", "checkpoint_caches", "copy_state", "cut", "cuttable", "prefill",
           "small_state"]
