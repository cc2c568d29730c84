"""Right-justified rows over key/value planes ``[B, H, capacity, w]`` with positions on axis 2.

This is mlx-lm's ``BatchKVCache`` geometry: every row ends at the write head ``offset``; row b occupies columns
``[offset - row_offsets[b], offset)`` and the columns before hold zeros. Appends are the serial ``KVCache`` path
(grow in 256-token steps, slice-write at the head), so one row with no padding is exactly mlx-lm's cache. A
subclass says how an append becomes planes (``_encode``) and what a read returns (``_fetch``); trim, speculative
rounds, prefill padding and row membership live here. Every operation validates, then stages, then publishes, so a
rejected call changes nothing. An
append keeps the edit epoch (``cache_parts.EditEpoch``); everything else that may touch stored columns bumps it.

mlx-lm model code reading ``offset`` of a batch gets per-row positions, as from mlx-lm's ``BatchKVCache``; every
other reader gets the width (see ``model_face``). ``BatchGenerator``'s names (``merge``, ``extend``, ``filter``,
``extract``, ``prepare``, ``finalize``, ``left_padding``) map onto the row operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...errors import InvalidCacheState
from ..cache_parts import ReuseFloor, describe, extract_one_row, source_row_states
from ..justified import RowBookkeeping
from ..rows import check_keep, check_row, non_negative, owned, prefill_leads, row_roll_indices
from .masks import attention_mask
from .model_face import MlxLmBatchFace, batch_positions

STEP = 256
AXIS = 2


@dataclass
class KvRowState:
    """One row with its padding removed: per plane an owned ``[1, H, T, w]`` (no planes before the first append)."""

    planes: list[mx.array]
    offset: int
    minimum_reusable_offset: int = 0


def zero_columns(array: mx.array, pads: Sequence[int]) -> mx.array:
    """Columns (axis 2) before ``pads[b]`` of row b set to zero, every other bit kept."""
    if not any(p > 0 for p in pads):
        return array
    cols = mx.arange(array.shape[AXIS], dtype=mx.int32)[None, None, :, None]
    valid = cols >= mx.array([int(p) for p in pads], dtype=mx.int32)[:, None, None, None]
    return mx.where(valid, array, mx.zeros((1, 1, 1, 1), dtype=array.dtype))


def roll_columns_right(array: mx.array, shifts: Sequence[int]) -> mx.array:
    """Row b rolled right by ``shifts[b]`` along axis 2 (mlx-lm's ``dynamic_roll``)."""
    if not any(shifts):
        return array
    b, _, length, _ = array.shape
    indices = row_roll_indices(length, shifts).reshape(b, 1, length, 1)
    return mx.take_along_axis(array, indices, axis=AXIS)


def check_kv_inputs(keys: Any, values: Any) -> tuple[int, int, int]:
    """``(B, H, L)`` of one append: rank-4 mlx arrays ``[B, H, L, Dk]`` / ``[B, H, L, Dv]`` with L >= 1."""
    for name, array in (("keys", keys), ("values", values)):
        if not isinstance(array, mx.array) or array.ndim != 4:
            got = f"rank {array.ndim}" if isinstance(array, mx.array) else type(array).__name__
            raise InvalidCacheState(f"{name} must be a rank-4 [B, H, L, D] mlx array (got {got})")
    if tuple(keys.shape[:3]) != tuple(values.shape[:3]):
        raise InvalidCacheState(f"keys {list(keys.shape)} and values {list(values.shape)} differ in [B, H, L]")
    b, h, length = keys.shape[:3]
    if b < 1 or h < 1 or length < 1:
        raise InvalidCacheState(f"an append needs at least one row, head and token (got keys {list(keys.shape)})")
    return b, h, length


class TokenRows(ReuseFloor, RowBookkeeping, MlxLmBatchFace):
    """Row bookkeeping and storage for the token-axis key/value caches (see the module docstring)."""

    step = STEP

    def __init__(self) -> None:
        self._planes: list[mx.array] = []
        self._reset_rows()

    def _reset_rows(self) -> None:
        super()._reset_rows()
        self._minimum = 0

    # -- subclass hooks ------------------------------------------------------------------------------------------
    def _encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        """The stored planes ``[B, H, L, w]`` of one append (raises before anything is published)."""
        raise NotImplementedError

    def _fetch(self, planes: list[mx.array]) -> Any:
        """What ``update_and_fetch`` returns, given every plane cut to the live columns."""
        raise NotImplementedError

    def _new_empty(self) -> TokenRows:
        raise NotImplementedError

    def signature(self) -> str:
        raise NotImplementedError

    # -- row layout ----------------------------------------------------------------------------------------------
    @property
    def offset(self) -> int | mx.array:
        """The width (every row ends at this column); to mlx-lm code reading a batch, per-row positions."""
        return batch_positions(self._width, self._offsets, self._batch_face)

    @property
    def _idx(self) -> int:
        """The write head under mlx-lm's ``BatchKVCache`` name: its ``extend`` reads it from the batch it joins."""
        return self._width

    @property
    def left_padding(self) -> mx.array:
        """Per-row padding columns in front of each row, as mlx-lm's ``BatchKVCache`` holds it."""
        return mx.array(self.left_pad, dtype=mx.int32)

    @property
    def rope_offset(self) -> int | mx.array:
        """RoPE position of the next column per row: an int when rows agree, else int32 ``[B]`` (mlx-lm batches)."""
        if len(set(self._offsets)) <= 1:
            return self._offsets[0] if self._offsets else 0
        return mx.array(self._offsets, dtype=mx.int32)

    @property
    def state(self) -> list[mx.array]:
        """The held buffers (capacity included), so ``mx.eval([c.state for c in caches])`` materializes them."""
        return list(self._planes)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._planes)

    def size(self) -> int:
        return self._width

    def empty(self) -> bool:
        return not self._planes

    def _active(self) -> list[mx.array]:
        return [p[:, :, : self._width, :] for p in self._planes]

    def keys_and_values(self) -> Any:
        """The live window without appending (what the last ``update_and_fetch`` returned)."""
        if not self._planes:
            raise InvalidCacheState(f"this {self.signature()} cache holds no keys or values yet")
        return self._fetch(self._active())

    def bytes_per_token(self) -> int:
        """Stored bytes per extra position of one row (0 until the first append fixes the head geometry)."""
        return sum(p.shape[1] * p.shape[3] * p.itemsize for p in self._planes)

    def projected_bytes(self, tokens: int) -> int:
        return non_negative(tokens, "tokens") * self.bytes_per_token()

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """mlx-lm's mask for an N-token step before the append; rows with left padding get an array mask."""
        return attention_mask(N, self._width, return_array, window_size, self.left_pad)

    # -- appending -----------------------------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        batch, heads, length = check_kv_inputs(keys, values)
        if self._batch is not None and batch != self._batch:
            raise InvalidCacheState(f"append batch size {batch} != the cache's {self._batch}")
        pieces = self._encode(keys, values)
        self._check_pieces(pieces)
        leads = prefill_leads(self._offsets)
        if any(leads):  # columns landing in pending left padding are stored as zero planes, like merged padding
            pieces = [zero_columns(p, leads) for p in pieces]
        prev = self._width
        planes = self._planes
        if not planes or prev + length > planes[0].shape[AXIS]:
            extra = (length + self.step - 1) // self.step * self.step
            grown = []
            for i, piece in enumerate(pieces):
                zeros = mx.zeros((batch, heads, extra, piece.shape[3]), dtype=piece.dtype)
                if not planes:
                    grown.append(zeros)
                    continue
                old = planes[i][:, :, :prev, :] if prev % self.step else planes[i]
                grown.append(mx.concatenate([old, zeros], axis=AXIS))
            planes = grown
        for plane, piece in zip(planes, pieces):
            plane[:, :, prev : prev + length, :] = piece
        if self._batch is None:
            self._begin_rows(batch)
        self._planes = planes
        self._width = prev + length
        self._offsets = [o + length for o in self._offsets]
        return self._fetch(self._active())

    def _check_pieces(self, pieces: list[mx.array]) -> None:
        for i, (plane, piece) in enumerate(zip(self._planes, pieces)):
            if plane.shape[:2] != piece.shape[:2] or plane.shape[3] != piece.shape[3] or plane.dtype != piece.dtype:
                raise InvalidCacheState(
                    f"{self.signature()} append plane {i} is {list(piece.shape)} {piece.dtype}; the cache holds "
                    f"[{plane.shape[0]}, {plane.shape[1]}, T, {plane.shape[3]}] {plane.dtype}"
                )

    # -- trim and the speculative transaction ------------------------------------------------------------------
    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every row (clamped to the shortest row, as mlx-lm); returns the count."""
        n = min(non_negative(n, "trim count"), min(self._offsets, default=0))
        if n:
            self._edited()
            self._width -= n
            self._offsets = [o - n for o in self._offsets]
        return n

    def _relayout(self, shifts: Sequence[int]) -> None:
        self._edited()
        offsets = [o - s for o, s in zip(self._offsets, shifts)]
        pads = [self._width - o for o in offsets]
        drop = min(max(0, min(pads, default=0)), self._width)
        planes = self._planes
        if planes and any(shifts):
            planes = [zero_columns(roll_columns_right(a, shifts), pads)[:, :, drop:, :] for a in self._active()]
        elif planes and drop:
            planes = [a[:, :, drop:, :] for a in self._active()]
        self._planes = planes
        self._width -= drop
        self._offsets = offsets

    # -- rows joining and leaving ------------------------------------------------------------------------------------
    def _require_rows(self, what: str) -> None:
        if self._batch is None:
            raise InvalidCacheState(f"{what}: this {self.signature()} cache holds no rows")
        if self._prefill_pending:
            raise InvalidCacheState(f"{what} needs a finalized prefill; call finalize_prefill() first")

    def row_state(self, row: int) -> KvRowState:
        """Owned copies of row ``row`` with its padding removed."""
        self._require_rows("row_state")
        row = check_row(row, self._batch)
        start = self._width - self._offsets[row]
        planes = [owned(p[row : row + 1, :, start : self._width, :]) for p in self._planes]
        return KvRowState(planes, self._offsets[row], self._minimum)

    def _check_states(self, states: Sequence[KvRowState]) -> list[mx.array]:
        """A template plane per slot (``[]`` when no row has planes) after checking every state agrees."""
        template: list[mx.array] = []
        for i, state in enumerate(states):
            if not isinstance(state, KvRowState):
                raise InvalidCacheState(f"row {i}: expected a KvRowState (got {type(state).__name__})")
            non_negative(state.offset, "row state offset")
            non_negative(state.minimum_reusable_offset, "row state minimum_reusable_offset")
            if not state.planes:
                if state.offset:
                    raise InvalidCacheState(f"row {i} holds {state.offset} positions but no planes")
                continue
            if not template:
                template = list(state.planes)
            if len(state.planes) != len(template):
                raise InvalidCacheState(f"row {i} has {len(state.planes)} planes, row 0 has {len(template)}")
            for j, (plane, ref) in enumerate(zip(state.planes, template)):
                if (
                    not isinstance(plane, mx.array)
                    or plane.ndim != 4
                    or plane.shape[0] != 1
                    or plane.shape[2] != state.offset
                    or plane.shape[1] != ref.shape[1]
                    or plane.shape[3] != ref.shape[3]
                    or plane.dtype != ref.dtype
                ):
                    got = f"{list(plane.shape)} {plane.dtype}" if isinstance(plane, mx.array) else type(plane).__name__
                    raise InvalidCacheState(
                        f"row {i} plane {j} is {got}; expected [1, {ref.shape[1]}, {state.offset}, {ref.shape[3]}] "
                        f"{ref.dtype}"
                    )
        return template

    def merge_row_states(self, states: Sequence[KvRowState]) -> None:
        """Replace this cache's contents with ``states`` as rows (right-justified, zero left padding).

        The result keeps room for the next append (capacity ``ceil((width + 1) / 256) * 256``), so the first step
        after a restore writes in place as mlx-lm's does.
        """
        states = list(states)
        if not states:
            raise InvalidCacheState("merge needs at least one row")
        template = self._check_states(states)
        width = max(s.offset for s in states)
        planes = []
        if template:
            capacity = (width + self.step) // self.step * self.step
            for j, ref in enumerate(template):
                heads, w = ref.shape[1], ref.shape[3]
                rows = []
                for s in states:
                    parts = [mx.zeros((1, heads, width - s.offset, w), dtype=ref.dtype)] if width > s.offset else []
                    if s.planes:
                        parts.append(s.planes[j])
                    parts.append(mx.zeros((1, heads, capacity - width, w), dtype=ref.dtype))
                    rows.append(mx.concatenate(parts, axis=AXIS))
                planes.append(mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0])
        self._reset_rows()
        self._planes = planes
        self._begin_rows(len(states))
        self._width = width
        self._offsets = [s.offset for s in states]
        self._minimum = max(s.minimum_reusable_offset for s in states)

    def adopt_batch(self, planes: Sequence[mx.array], offsets: Sequence[int], minimum: int) -> None:
        """Take ``planes`` (``[B, H, capacity, w]``, capacity ``(max(offsets) // 256 + 1) * 256``, rows
        right-justified ending at column ``max(offsets)``, zeros elsewhere; ``[]`` when no row has head geometry) as
        this cache's rows, without copying: what ``merge_row_states`` builds, when the store wrote rows in place."""
        offsets = [non_negative(o, "row offset") for o in offsets]
        if not offsets:
            raise InvalidCacheState("adopt_batch needs at least one row")
        width = max(offsets)
        planes = list(planes)
        capacity = (width + self.step) // self.step * self.step
        if not planes and width:
            raise InvalidCacheState(f"adopt_batch: rows hold up to {width} positions but no planes were given")
        for j, plane in enumerate(planes):
            if (not isinstance(plane, mx.array) or plane.ndim != 4 or plane.shape[0] != len(offsets)
                    or plane.shape[2] != capacity):
                got = list(plane.shape) if isinstance(plane, mx.array) else type(plane).__name__
                raise InvalidCacheState(f"batched plane {j} is {got}; expected [{len(offsets)}, H, {capacity}, w]")
        self._reset_rows()
        self._planes = planes
        self._begin_rows(len(offsets))
        self._width, self._offsets = width, offsets
        self._minimum = non_negative(minimum, "minimum_reusable_offset")

    def _compatible(self, other: Any) -> bool:
        return type(other) is type(self) and other.signature() == self.signature()

    def make_empty_batch(self) -> TokenRows:
        return self._new_empty()

    def merge_rows(self, rows: Sequence[TokenRows]) -> None:
        """Replace this cache's contents with every source's rows, in order; sources are unchanged.

        A source with no rows contributes one zero-length row.
        """

        def check(source: Any) -> None:
            if not self._compatible(source):
                raise InvalidCacheState(f"cannot merge {describe(source)} into {self.signature()}")

        self.merge_row_states(
            source_row_states(rows, lambda source: KvRowState([], 0, source.minimum_reusable_offset), check)
        )

    def extract_row(self, row: int) -> TokenRows:
        return extract_one_row(self, row)

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` in that order; padding columns common to the survivors are removed."""
        if self._batch is None:
            raise InvalidCacheState(f"filter_rows: this {self.signature()} cache holds no rows")
        keep = check_keep(keep, self._batch)
        pads = self.left_pad
        drop = min(min(pads[k] for k in keep), self._width)
        index = mx.array(keep, dtype=mx.int32)
        self._planes = [mx.take(p[:, :, drop : self._width, :], index, axis=0) for p in self._planes]
        self._keep_row_bookkeeping(keep, self._width - drop)

    def _adopt_rows_of(self, source: TokenRows, planes: list[mx.array]) -> None:
        """Take ``source``'s row bookkeeping with new ``planes`` (conversions between storage kinds)."""
        self._edited()
        self._planes = planes
        self._batch, self._offsets, self._width = source._batch, list(source._offsets), source._width
        self._ends = None if source._ends is None else list(source._ends)
        self._prefill_pending, self._minimum = source._prefill_pending, source._minimum
        self._round = None if source._round is None else list(source._round)

    def dispose(self) -> None:
        self._edited()
        self._planes = []
        self._reset_rows()


__all__ = ["STEP", "KvRowState", "TokenRows", "check_kv_inputs", "roll_columns_right", "zero_columns"]
