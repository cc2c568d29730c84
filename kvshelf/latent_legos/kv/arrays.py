"""``ArraysCache(size)``: mlx-lm's recurrent-state cache (Mamba / gated DeltaNet conv and SSM states).

A list of ``size`` slots, each an array ``[B, ...]`` or None, that the model reads and replaces every step
(``cache[0] = conv_state``). The state summarizes every position, so it is never trimmable and a prefix of it does
not exist: a snapshot is reusable only at its exact length. ``offset`` is bookkeeping advanced by ``advance(n)``
(which mlx-lm models call after each forward; callers whose model does not must call it). mlx-lm's ``left_padding``
/ ``lengths`` / ``make_mask(N)`` / ``prepare`` / ``finalize`` are kept for padded batches.

A speculative rollback that rejects positions restores the state taken at ``spec_round_begin``; the owning layer
then replays the kept tokens (the state cannot be rewound any other way).

mlx-lm's ``mamba`` writes its new state only into a cache that ``isinstance`` mlx-lm's own ``ArraysCache``; it
would read this one and never write it, running every later step without history. A read from that model code
therefore raises ``InvalidCacheState`` (use mlx-lm's ``ArraysCache`` there; kvshelf saves it through
``kvshelf.mlx_lm``). mamba2 and qwen3_next write through ``cache[i] = ...`` and run on this class unchanged,
``BatchGenerator`` included (``merge``, ``extend``, ``filter``, ``extract``; padded steps keep per-row offsets).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...errors import CacheRangeError, InvalidCacheState
from ..cache_parts import ReuseFloor, describe, extract_one_row, source_row_states
from ..contracts import PrefillPadding
from ..justified import check_keep_counts, padding_rows
from ..rows import check_keep, check_row, non_negative, owned
from .model_face import MlxLmBatchFace

# mlx-lm modules that store recurrent state only into ``isinstance(cache, mlx_lm...ArraysCache)`` caches.
WRITES_ONLY_MLX_LM_ARRAYS = ("mlx_lm.models.mamba",)


def _read_by_isinstance_gated_model() -> bool:
    return sys._getframe(2).f_globals.get("__name__", "") in WRITES_ONLY_MLX_LM_ARRAYS


@dataclass
class ArraysRowState:
    """One row: per slot an owned ``[1, ...]`` array or None, with the row's offset and floor."""

    slots: list[mx.array | None]
    offset: int
    minimum_reusable_offset: int = 0


class ArraysCache(ReuseFloor, MlxLmBatchFace):
    """Recurrent state slots (see the module docstring)."""

    def __init__(self, size: int, left_padding: Sequence[int] | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidCacheState(f"ArraysCache size must be a positive integer (got {size!r})")
        self.size_slots = size
        self._reset()
        if left_padding:
            self.prepare_prefill(PrefillPadding([0] * len(left_padding), left_padding=left_padding))
            self._prefill_pending = False

    def _reset(self) -> None:
        self.cache: list[mx.array | None] = [None] * self.size_slots
        self.left_padding: mx.array | None = None
        self.lengths: mx.array | None = None
        self._batch: int | None = None
        self._offsets: list[int] = []
        self._ends: list[int] | None = None
        self._prefill_pending = False
        self._minimum = 0
        self._round: tuple[list[int], list[mx.array | None]] | None = None

    # -- mlx-lm's slot access --------------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> mx.array | None:
        if _read_by_isinstance_gated_model():
            raise InvalidCacheState(
                "mlx-lm's mamba stores its state only into mlx_lm.models.cache.ArraysCache, so with kvshelf's "
                "ArraysCache it would run without history; use make_prompt_cache(model) (mlx-lm's caches, which "
                "kvshelf saves and restores through kvshelf.mlx_lm)"
            )
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array | None) -> None:
        if value is not None:
            if not isinstance(value, mx.array) or value.ndim < 1:
                got = type(value).__name__
                raise InvalidCacheState(f"slot {index} takes an mlx array [B, ...] or None (got {got})")
            if self._batch is not None and value.shape[0] != self._batch:
                raise InvalidCacheState(f"slot {index} batch {value.shape[0]} != the cache's {self._batch}")
        self.cache[index] = value
        if value is not None and self._batch is None:
            self._begin_rows(value.shape[0])

    def _begin_rows(self, batch: int) -> None:
        self._batch, self._offsets = batch, [0] * batch

    def advance(self, n: int) -> None:
        """``n`` more positions were consumed by every row (mlx-lm models call this after each forward)."""
        non_negative(n, "advance count")
        if self._batch is None:
            raise InvalidCacheState("advance: this arrays cache holds no rows yet (set a slot first)")
        self._offsets = [o + n for o in self._offsets]
        if self.lengths is not None:
            self.lengths = self.lengths - n
        if self.left_padding is not None:
            self.left_padding = self.left_padding - n

    def make_mask(self, N: int) -> mx.array | None:
        """Valid input columns per row during a padded step (mlx-lm's rule); None when nothing is padded."""
        pos = mx.arange(N)
        mask = None
        if self.left_padding is not None:
            mask = pos >= self.left_padding[:, None]
        if self.lengths is not None:
            inside = pos < self.lengths[:, None]
            mask = inside if mask is None else mask & inside
        return mask

    def prepare(self, *, lengths: Sequence[int] | None = None, right_padding: Sequence[int] | None = None,
                **_: Any) -> None:
        """mlx-lm's hook: the valid lengths of the next padded step (with right padding, rows stop counting at
        their own end, as ``prepare_prefill``)."""
        if lengths is not None and right_padding is not None and any(int(p) for p in right_padding):
            padding = PrefillPadding([int(n) for n in lengths], right_padding=[int(p) for p in right_padding])
            self.prepare_prefill(padding)
            return
        self.lengths = None if lengths is None else mx.array(list(lengths))

    def finalize(self) -> None:
        if self._prefill_pending:
            self.finalize_prefill()  # clamps each row's offset, then clears the padding (back here)
            return
        self.lengths = None
        self.left_padding = None

    # -- identity and accounting -----------------------------------------------------------------------------------
    def signature(self) -> str:
        return f"arrays:{self.size_slots}"

    @property
    def offset(self) -> int:
        return max(self._offsets, default=0)

    @property
    def batch_size(self) -> int | None:
        return self._batch

    @property
    def row_offsets(self) -> list[int]:
        return list(self._offsets)

    @property
    def left_pad(self) -> list[int]:
        return [0] * (self._batch or 0)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def empty(self) -> bool:
        return self.cache[0] is None

    def bytes_per_token(self) -> int:
        return 0

    def projected_bytes(self, tokens: int) -> int:
        """One row's state bytes: constant in the token count."""
        non_negative(tokens, "tokens")
        return sum(a.nbytes // a.shape[0] for a in self.state)

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        if non_negative(n, "trim count"):
            raise CacheRangeError("recurrent state cannot be trimmed (it summarizes every position)")
        return 0

    # -- the speculative transaction: snapshot, restore, replay ------------------------------------------------------
    def spec_round_begin(self) -> None:
        self._round = (list(self._offsets), [None if a is None else owned(a) for a in self.cache])

    def spec_round_commit(self) -> None:
        self._round = None

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        """All kept: commit. Otherwise restore the state at begin; the layer replays the kept tokens."""
        if self._round is None:
            raise InvalidCacheState("spec_round_rollback without spec_round_begin")
        before, slots = self._round
        appended = [o - b for o, b in zip(self._offsets, before)]
        counts = check_keep_counts(keep, appended)
        if counts != appended:
            self.cache, self._offsets = slots, list(before)
        self._round = None

    # -- prefill padding -------------------------------------------------------------------------------------------
    def prepare_prefill(self, padding: PrefillPadding) -> None:
        rows = padding_rows(padding, self._batch)
        left = padding.left_padding or [0] * rows
        if any(left) and any(self._offsets):
            raise InvalidCacheState("left padding can only be added to a cache with no consumed positions")
        if self._batch is None:
            self._begin_rows(rows)
        self._offsets = [o - p for o, p in zip(self._offsets, left)]
        if any(left):
            self.left_padding = mx.array(list(left))
        right = padding.right_padding
        if right and any(right):
            self._ends = [o + n for o, n in zip(self._offsets, padding.lengths)]
            self.lengths = mx.array(list(padding.lengths))
        self._prefill_pending = True

    def finalize_prefill(self) -> None:
        """Rows stop counting at their own end (the model froze their state there through ``make_mask``)."""
        if not self._prefill_pending:
            return
        if self._ends is not None:
            self._offsets = [min(o, e) for o, e in zip(self._offsets, self._ends)]
        self._ends, self._prefill_pending = None, False
        self.finalize()

    # -- rows joining and leaving ------------------------------------------------------------------------------------
    def make_empty_batch(self) -> ArraysCache:
        return ArraysCache(self.size_slots)

    def row_state(self, row: int) -> ArraysRowState:
        if self._batch is None:
            raise InvalidCacheState("row_state: this arrays cache holds no rows")
        if self._prefill_pending:
            raise InvalidCacheState("row_state needs a finalized prefill; call finalize_prefill() first")
        row = check_row(row, self._batch)
        slots = [None if a is None else owned(a[row : row + 1]) for a in self.cache]
        return ArraysRowState(slots, self._offsets[row], self._minimum)

    def merge_row_states(self, states: Sequence[ArraysRowState]) -> None:
        """Replace this cache's contents with ``states`` as rows; a slot absent in some rows is zeros there."""
        states = list(states)
        if not states:
            raise InvalidCacheState("merge needs at least one row")
        templates: list[mx.array | None] = [None] * self.size_slots
        for i, s in enumerate(states):
            if not isinstance(s, ArraysRowState):
                raise InvalidCacheState(f"row {i}: expected an ArraysRowState (got {type(s).__name__})")
            non_negative(s.offset, "row offset")
            non_negative(s.minimum_reusable_offset, "row minimum_reusable_offset")
            if len(s.slots) != self.size_slots:
                raise InvalidCacheState(f"row {i} has {len(s.slots)} slots, this cache has {self.size_slots}")
            for j, a in enumerate(s.slots):
                if a is None:
                    continue
                if not isinstance(a, mx.array) or a.ndim < 1 or a.shape[0] != 1:
                    raise InvalidCacheState(f"row {i} slot {j} must be an mlx array [1, ...]")
                ref = templates[j]
                if ref is None:
                    templates[j] = a
                elif a.shape != ref.shape or a.dtype != ref.dtype:
                    raise InvalidCacheState(
                        f"row {i} slot {j} is {list(a.shape)} {a.dtype}; another row has {list(ref.shape)} {ref.dtype}"
                    )
        slots: list[mx.array | None] = []
        for j, ref in enumerate(templates):
            if ref is None:
                slots.append(None)
                continue
            rows = [s.slots[j] if s.slots[j] is not None else mx.zeros(ref.shape, dtype=ref.dtype) for s in states]
            slots.append(mx.concatenate(rows, axis=0) if len(rows) > 1 else owned(rows[0]))
        self._reset()
        self.cache = slots
        self._begin_rows(len(states))
        self._offsets = [s.offset for s in states]
        self._minimum = max(s.minimum_reusable_offset for s in states)

    def merge_rows(self, rows: Sequence[ArraysCache]) -> None:
        def check(source: Any) -> None:
            if type(source) is not ArraysCache or source.size_slots != self.size_slots:
                raise InvalidCacheState(f"cannot merge {describe(source)} into {self.signature()}")

        def empty(source: ArraysCache) -> ArraysRowState:
            return ArraysRowState([None] * self.size_slots, 0, source.minimum_reusable_offset)

        self.merge_row_states(source_row_states(rows, empty, check))

    def extract_row(self, row: int) -> ArraysCache:
        return extract_one_row(self, row)

    def filter_rows(self, keep: Sequence[int]) -> None:
        if self._batch is None:
            raise InvalidCacheState("filter_rows: this arrays cache holds no rows")
        keep = check_keep(keep, self._batch)
        index = mx.array(keep, dtype=mx.int32)
        self.cache = [None if a is None else mx.take(a, index, axis=0) for a in self.cache]
        if self.left_padding is not None:
            self.left_padding = mx.take(self.left_padding, index, axis=0)
        if self.lengths is not None:
            self.lengths = mx.take(self.lengths, index, axis=0)
        self._batch = len(keep)
        self._offsets = [self._offsets[k] for k in keep]
        if self._ends is not None:
            self._ends = [self._ends[k] for k in keep]
        if self._round is not None:
            before, slots = self._round
            self._round = ([before[k] for k in keep], [None if a is None else mx.take(a, index, axis=0) for a in slots])

    def dispose(self) -> None:
        self._reset()


__all__ = ["ArraysCache", "ArraysRowState"]
