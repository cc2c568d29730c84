"""The face a key/value lego shows to mlx-lm's model and batching code, next to kvshelf's own row contract.

Two conventions meet on one attribute. kvshelf's row contract says ``offset`` is the batch width (every row ends at
that column; ``row_offsets`` holds the per-row counts). mlx-lm's model code calls ``rope(x, offset=cache.offset)``
and, for its batched ``BatchKVCache``, ``offset`` is an int32 array of per-row positions. A batch of rows of
unequal length given the width would rotate the shorter rows' new keys at the wrong positions, silently.

So ``offset`` answers by who reads it: code in mlx-lm (or mlx-vlm, which shares its model convention) reading a
cache that holds two or more rows gets mlx-lm's per-row positions, exactly what a ``BatchKVCache`` holding the
same rows would answer (RoPE with an equal-valued array is bit-identical to the int); everyone else gets kvshelf's
width. A cache holding one row answers the same int to both. Model code of one's own, written in mlx-lm's
convention outside those packages, reads ``rope_offset`` (per-row positions, int when rows agree).

``MlxLmBatchFace`` adds the names mlx-lm's ``BatchGenerator`` calls on a cache — ``merge``, ``extend``,
``filter``, ``extract``, ``prepare`` and ``finalize`` — on top of kvshelf's row operations, so
restored rows join mlx-lm's continuous batching as they are.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ...errors import InvalidCacheState
from ..contracts import PrefillPadding


class NotForModelCode(InvalidCacheState, AttributeError):
    """An mlx-lm attribute this lego cannot offer (an AttributeError too, so ``hasattr`` stays a plain probe)."""


# Packages whose code reads ``cache.offset`` the way mlx-lm's batched caches define it.
MODEL_PACKAGES = ("mlx_lm", "mlx_vlm")


def read_by_model_code(depth: int = 2) -> bool:
    """Whether the code ``depth`` frames up (the reader of a property) lives in one of ``MODEL_PACKAGES``."""
    module = sys._getframe(depth).f_globals.get("__name__", "")
    return module.split(".", 1)[0] in MODEL_PACKAGES


def batch_positions(width: int, row_offsets: Sequence[int], batch_face: bool = False) -> int | mx.array:
    """``offset`` for the caller two frames up: the width, or per-row positions for mlx-lm code reading a batch
    (two or more rows, or any cache mlx-lm's ``merge`` made, which mlx-lm then treats as its batched class)."""
    if (len(row_offsets) > 1 or batch_face) and read_by_model_code(3):
        return mx.array(list(row_offsets), dtype=mx.int32)
    return width


def indices(batch_indices: Any) -> list[int]:
    """mlx-lm passes row selections as a list or an int array; kvshelf's row calls take a list of ints."""
    if isinstance(batch_indices, mx.array):
        return [int(i) for i in batch_indices.tolist()]
    return [int(i) for i in batch_indices]


class MlxLmBatchFace:
    """mlx-lm's batching names over kvshelf's row operations (``merge_rows``, ``filter_rows``, ``extract_row``,
    ``prepare_prefill``, ``finalize_prefill``). A subclass may accept mlx-lm's own cache objects as merge sources
    by overriding ``_row_source``."""

    # Set on what ``merge`` builds: mlx-lm then handles it as its batched class (its ``BatchKVCache.extend`` reads
    # ``offset`` as a per-row array even for one row).
    _batch_face = False

    def _row_source(self, cache: Any) -> Any:
        """A source ``merge_rows`` accepts for ``cache`` (a kvshelf cache is taken as it is)."""
        return cache

    def merge(self, caches: Sequence[Any]) -> Any:
        """A new batch holding every cache's rows in order (mlx-lm's ``merge``); the sources are unchanged."""
        out = self.make_empty_batch()
        out.merge_rows([self._row_source(c) for c in caches])
        out._batch_face = True
        return out

    def extend(self, other: Any) -> None:
        """Append ``other``'s rows after this cache's (mlx-lm's ``extend``), in place."""
        sources = [self._row_source(other)]
        if self.batch_size is not None:
            sources.insert(0, self.extract_all())
        merged = self.make_empty_batch()
        merged.merge_rows(sources)
        self._take_contents_of(merged)

    def extract_all(self) -> Any:
        """A copy of this cache (every row) that ``merge_rows`` accepts as one source."""
        out = self.make_empty_batch()
        out.merge_rows([self])
        return out

    def _take_contents_of(self, other: Any) -> None:
        self.__dict__.update(other.__dict__)
        edited = getattr(self, "_edited", None)
        if edited is not None:  # other's epoch is unique already; bump so this cache's is its own again
            edited()

    def filter(self, batch_indices: Any) -> None:
        """Keep the rows ``batch_indices`` in that order (mlx-lm's ``filter``)."""
        self.filter_rows(indices(batch_indices))

    def extract(self, idx: int) -> Any:
        """Row ``idx`` as a serial cache of this class (mlx-lm's ``extract``)."""
        return self.extract_row(int(idx))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None, **_: Any) -> None:
        """mlx-lm's padded-prefill hook, as ``prepare_prefill``."""
        rows = next((len(list(x)) for x in (lengths, left_padding, right_padding) if x is not None), None)
        if rows is None:
            return
        if lengths is None:
            if right_padding is not None and any(int(p) for p in right_padding):
                raise InvalidCacheState("prepare: right padding needs the rows' lengths")
            lengths = [0] * rows
        self.prepare_prefill(PrefillPadding(
            [int(n) for n in lengths],
            left_padding=None if left_padding is None else [int(p) for p in left_padding],
            right_padding=None if right_padding is None else [int(p) for p in right_padding],
        ))

    def finalize(self) -> None:
        """mlx-lm's end-of-padded-prefill hook, as ``finalize_prefill``."""
        self.finalize_prefill()


__all__ = ["MODEL_PACKAGES", "MlxLmBatchFace", "NotForModelCode", "batch_positions", "indices", "read_by_model_code"]
