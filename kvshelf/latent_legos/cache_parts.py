"""Pieces every cache class shares: the edit epoch, the cache-wide reuse floor and row membership through row states.

``merge_rows`` and ``extract_row`` are the same everywhere a cache can export and import one row
(``row_state`` / ``merge_row_states``); only the checks on a source and what an empty source contributes differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidCacheState
from .rows import non_negative


_EPOCHS = itertools.count(1)


class EditEpoch:
    """``kvshelf_epoch``: a value that changes on every operation that may alter a stored position below the
    current offset (trim, rollback, relayout, row filter/merge/adopt, setters, dispose...), and stays the same
    across pure appends at the end (the ``EditEpoch`` protocol in ``contracts.py``).

    Why: the store re-hashes only the chunks of a grown session that it cannot prove unchanged since the session's
    last save, and this is the proof the cache gives. Epochs come from one process-wide counter, so a value is
    never reused, by this cache or any other (``_take_contents_of`` copying another cache's dict stays safe).
    A redundant bump costs one skipped reuse; a missing one would store stale bytes, so methods bump when in doubt.
    """

    _epoch = 0

    @property
    def kvshelf_epoch(self) -> int:
        return self._epoch

    def _edited(self) -> None:
        self._epoch = next(_EPOCHS)


class ReuseFloor:
    """``minimum_reusable_offset`` held as one validated int in ``_minimum`` (setting it is an edit for caches
    with an epoch; ``PagedLatentCache``, ``RotatingKVCache`` and ``ArraysCache`` have none)."""

    _minimum: int

    @property
    def minimum_reusable_offset(self) -> int:
        return self._minimum

    @minimum_reusable_offset.setter
    def minimum_reusable_offset(self, value: int) -> None:
        self._minimum = non_negative(value, "minimum_reusable_offset")
        edited = getattr(self, "_edited", None)
        if edited is not None:
            edited()


def describe(source: object) -> str:
    """How an error names a merge source: its signature, else its type."""
    return source.signature() if hasattr(source, "signature") else type(source).__name__


def source_row_states(
    sources: Sequence[Any], empty_state: Callable[[Any], Any], check: Callable[[Any], None] | None = None
) -> list[Any]:
    """Every source's row states in order, each source checked first; a source with no rows gives ``empty_state``."""
    sources = list(sources)
    if not sources:
        raise InvalidCacheState("merge_rows needs at least one source cache")
    states: list[Any] = []
    for source in sources:
        if check is not None:
            check(source)
        if source.batch_size is None:
            states.append(empty_state(source))
        else:
            states.extend(source.row_state(r) for r in range(source.batch_size))
    return states


def extract_one_row(cache: Any, row: int) -> Any:
    """A new cache like ``cache`` holding only row ``row`` (copied through its row state)."""
    out = cache.make_empty_batch()
    out.merge_row_states([cache.row_state(row)])
    return out


__all__ = ["EditEpoch", "ReuseFloor", "describe", "extract_one_row", "source_row_states"]
