"""``RotatingKVCache(max_size, keep=0)``: mlx-lm's sliding-window ring (``kv:rotating-plain``).

State: key/value buffers ``[B, H, S, D]``, ``offset`` (every position ever appended), the write head ``idx``, the
window ``max_size`` and ``keep`` leading positions that are never overwritten.

* A one-token append writes in place: the buffer grows in 256-slot steps up to ``max_size``, then the head wraps
  to ``keep``. Reads are ``[:offset]`` until the ring fills, then the whole ring (ring order).
* A multi-token append first lays the buffer out in time order, keeps ``max_size - 1`` positions of history (the
  ``keep`` first ones included) and concatenates the block, so the buffer may hold ``max_size - 1 + L`` positions.
* Trimmable only before the ring wraps (``offset < max_size``), as in mlx-lm. A speculative rollback right after a
  single multi-token append may also cut the block's tail after the wrap (the buffer is in time order then).

Rows batch together only when laid out alike (same offset, head and buffer length — e.g. rows that saw the same
appends); there is no left padding in a ring, so ``prepare_prefill`` takes unpadded rows only. mlx-lm's
``BatchGenerator`` names (``merge``, ``extend``, ``filter``, ``extract``, ``prepare``, ``finalize``) follow the same
rule: rows laid out differently, or a padded prompt step, raise ``InvalidCacheState`` rather than run misaligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...errors import CacheRangeError, InvalidCacheState
from ..cache_parts import ReuseFloor, describe, extract_one_row, source_row_states
from ..contracts import PrefillPadding
from ..justified import check_keep_counts, padding_rows
from ..rows import check_keep, check_row, non_negative, owned
from .dtypes import check_kv_dtypes
from .masks import causal_mask
from .model_face import MlxLmBatchFace
from .token_rows import check_kv_inputs

STEP = 256


@dataclass
class RingRowState:
    """One row of a ring: owned ``[1, H, S, D]`` buffers (None before the first append) and the ring scalars."""

    keys: mx.array | None
    values: mx.array | None
    offset: int
    idx: int
    minimum_reusable_offset: int = 0


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidCacheState(f"{name} must be a positive integer (got {value!r})")
    return value


class RotatingKVCache(ReuseFloor, MlxLmBatchFace):
    """A sliding-window key/value ring (see the module docstring)."""

    step = STEP

    def __init__(self, max_size: int, keep: int = 0) -> None:
        self.max_size = _positive(max_size, "max_size")
        self.keep = non_negative(keep, "keep")
        if self.keep >= self.max_size:
            raise InvalidCacheState(f"keep {keep} must be below max_size {max_size}")
        self._keys: mx.array | None = None
        self._values: mx.array | None = None
        self._reset()

    def _reset(self) -> None:
        self._keys = self._values = None
        self._offset = 0
        self._idx = 0
        self._batch: int | None = None
        self._minimum = 0
        self._round: int | None = None
        self._round_concat: int | None = None  # positions of the one concat since begin (None: other writes)

    # -- identity and accounting -----------------------------------------------------------------------------------
    def signature(self) -> str:
        return "kv:rotating-plain"

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def idx(self) -> int:
        """The ring's write head (mlx-lm's ``_idx``)."""
        return self._idx

    @property
    def keys(self) -> mx.array | None:
        return self._keys

    @property
    def values(self) -> mx.array | None:
        return self._values

    @property
    def batch_size(self) -> int | None:
        return self._batch

    @property
    def row_offsets(self) -> list[int]:
        return [self._offset] * (self._batch or 0)

    @property
    def left_pad(self) -> list[int]:
        return [0] * (self._batch or 0)

    @property
    def rope_offset(self) -> int:
        return self._offset

    @property
    def state(self) -> list[mx.array]:
        return [] if self._keys is None else [self._keys, self._values]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def size(self) -> int:
        return min(self._offset, self.max_size)

    def empty(self) -> bool:
        return self._keys is None

    def bytes_per_token(self) -> int:
        """Bytes per stored position of one row (0 until the first append fixes the head geometry)."""
        if self._keys is None:
            return 0
        k, v = self._keys, self._values
        return k.shape[1] * (k.shape[3] * k.itemsize + v.shape[3] * v.itemsize)

    def projected_bytes(self, tokens: int) -> int:
        return min(non_negative(tokens, "tokens"), self.max_size) * self.bytes_per_token()

    # -- appending -----------------------------------------------------------------------------------------------
    def _cut_front(self, v: mx.array, trim: int, append: mx.array | None = None) -> mx.array:
        parts = [v[:, :, : self.keep, :], v[:, :, trim + self.keep :, :]] if trim > 0 else [v]
        if append is not None:
            parts.append(append)
        return mx.concatenate(parts, axis=2)

    def _time_order(self, v: mx.array) -> mx.array:
        """The buffer in time order (the keep positions first), unused slots cut off."""
        if self._idx == v.shape[2]:
            return v
        if self._idx < self._offset:
            parts = [v[:, :, : self.keep, :], v[:, :, self._idx :, :], v[:, :, self.keep : self._idx, :]]
            return mx.concatenate(parts, axis=2)
        return v[:, :, : self._idx, :]

    def _check_append(self, keys: mx.array, values: mx.array) -> int:
        batch, _, length = check_kv_inputs(keys, values)
        check_kv_dtypes(keys, values)
        if self._batch is not None and batch != self._batch:
            raise InvalidCacheState(f"append batch size {batch} != the cache's {self._batch}")
        if self._keys is not None:
            for name, new, old in (("keys", keys, self._keys), ("values", values, self._values)):
                if new.shape[1] != old.shape[1] or new.shape[3] != old.shape[3] or new.dtype != old.dtype:
                    raise InvalidCacheState(
                        f"{name} {list(new.shape)} {new.dtype} do not match the ring's "
                        f"[{old.shape[0]}, {old.shape[1]}, S, {old.shape[3]}] {old.dtype}"
                    )
        return length

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        length = self._check_append(keys, values)
        if self._batch is None:
            self._batch = keys.shape[0]
        if length == 1:
            out = self._update_in_place(keys, values)
            self._round_concat = None
        else:
            fresh = self._round is not None and self._round == self._offset
            out = self._update_concat(keys, values)
            self._round_concat = length if fresh else None
        return out

    def _update_concat(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._keys is None:
            k, v = owned(keys), owned(values)
        else:
            k, v = self._time_order(self._keys), self._time_order(self._values)
            trim = k.shape[2] - self.max_size + 1
            k, v = self._cut_front(k, trim, keys), self._cut_front(v, trim, values)
        self._keys, self._values = k, v
        self._offset += keys.shape[2]
        self._idx = k.shape[2]
        return k[:, :, :, :], v[:, :, :, :]

    def _update_in_place(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch, heads, _, dk = keys.shape
        k, v = self._keys, self._values
        length = 0 if k is None else k.shape[2]
        if k is None or (self._offset >= length and length < self.max_size):
            grow = min(self.step, self.max_size - length)
            new_k = mx.zeros((batch, heads, grow, dk), dtype=keys.dtype)
            new_v = mx.zeros((batch, heads, grow, values.shape[3]), dtype=values.dtype)
            k = new_k if k is None else mx.concatenate([k, new_k], axis=2)
            v = new_v if v is None else mx.concatenate([v, new_v], axis=2)
            self._idx = length
        trim = k.shape[2] - self.max_size
        if trim > 0:
            k, v = self._cut_front(k, trim), self._cut_front(v, trim)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        k[:, :, self._idx : self._idx + 1, :] = keys
        v[:, :, self._idx : self._idx + 1, :] = values
        self._keys, self._values = k, v
        self._offset += 1
        self._idx += 1
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        if self._keys is None:
            raise InvalidCacheState("this rotating cache holds no keys or values yet")
        n = min(self._offset, self._keys.shape[2])
        return self._keys[:, :, :n, :], self._values[:, :, :n, :]

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        """mlx-lm's ring mask: causal over the (at most ``max_size - 1``) history, windowed once it exceeds it."""
        if isinstance(N, bool) or not isinstance(N, int) or N < 1:
            raise InvalidCacheState(f"mask step must be a positive integer (got {N!r})")
        if N > 1:
            window = window_size or self.max_size
            start = min(self.max_size - 1, self._offset)
            if start + N > window or return_array:
                return causal_mask(N, start, window)
            return "causal"
        if window_size is None or not (self._offset >= window_size and self.max_size > window_size):
            return None
        head = 0 if self._idx >= self.max_size else self._idx
        width = self._offset + 1 if self._offset < self.max_size else self.max_size
        mask = mx.arange(width) >= (width - window_size)
        return mx.roll(mask, shift=head + 1)

    # -- trim and the speculative transaction ------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return self._offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(non_negative(n, "trim count"), self._offset)
        if n and not self.is_trimmable():
            raise CacheRangeError(
                f"the ring wrapped ({self._offset} positions, max_size {self.max_size}); it cannot be trimmed"
            )
        self._offset -= n
        self._idx -= n
        return n

    def spec_round_begin(self) -> None:
        self._round = self._offset
        self._round_concat = None

    def spec_round_commit(self) -> None:
        self._round = None
        self._round_concat = None

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        """Keep ``keep`` of the round's positions (rows of a ring share one count)."""
        if self._round is None:
            raise InvalidCacheState("spec_round_rollback without spec_round_begin")
        appended = self._offset - self._round
        counts = check_keep_counts(keep, [appended] * (self._batch or 1))
        if len(set(counts)) > 1:
            raise InvalidCacheState(f"rows of a ring keep one count; got {counts}")
        rejected = appended - counts[0]
        if rejected and self.is_trimmable():
            self.trim(rejected)
        elif rejected and self._round_concat is not None and self._round_concat >= rejected:
            cut = self._keys.shape[2] - rejected  # time-ordered after the concat: the tail is the rejected block
            self._keys, self._values = self._keys[:, :, :cut, :], self._values[:, :, :cut, :]
            self._offset -= rejected
            self._idx = cut
        elif rejected:
            raise CacheRangeError(
                f"cannot roll back {rejected} positions: the ring wrapped and the round was not one multi-token append"
            )
        self._round = None
        self._round_concat = None

    # -- prefill padding (rings take unpadded rows only) -----------------------------------------------------------
    def prepare_prefill(self, padding: PrefillPadding) -> None:
        rows = padding_rows(padding, self._batch)
        if any(padding.left_padding or ()) or any(padding.right_padding or ()):
            raise InvalidCacheState("a rotating cache takes unpadded prefill only (a ring has no padding columns)")
        if self._batch is None:
            self._batch = rows

    def finalize_prefill(self) -> None:
        return None

    # -- rows joining and leaving ------------------------------------------------------------------------------------
    def make_empty_batch(self) -> RotatingKVCache:
        return RotatingKVCache(self.max_size, self.keep)

    def row_state(self, row: int) -> RingRowState:
        if self._batch is None:
            raise InvalidCacheState("row_state: this rotating cache holds no rows")
        row = check_row(row, self._batch)
        if self._keys is None:
            return RingRowState(None, None, self._offset, self._idx, self._minimum)
        return RingRowState(
            owned(self._keys[row : row + 1]), owned(self._values[row : row + 1]), self._offset, self._idx, self._minimum
        )

    def _check_state(self, i: int, s: RingRowState, ref: RingRowState) -> None:
        if not isinstance(s, RingRowState):
            raise InvalidCacheState(f"row {i}: expected a RingRowState (got {type(s).__name__})")
        non_negative(s.offset, "row offset")
        non_negative(s.idx, "row ring head")
        non_negative(s.minimum_reusable_offset, "row minimum_reusable_offset")
        if (s.keys is None) != (s.values is None):
            raise InvalidCacheState(f"row {i}: keys and values must both be present or both absent")
        if s.keys is None:
            if s.offset or s.idx:
                raise InvalidCacheState(f"row {i} holds {s.offset} positions but no buffers")
        else:
            for name, a in (("keys", s.keys), ("values", s.values)):
                if not isinstance(a, mx.array) or a.ndim != 4 or a.shape[0] != 1:
                    raise InvalidCacheState(f"row {i} {name} must be a [1, H, S, D] mlx array")
            if s.keys.shape[:3] != s.values.shape[:3]:
                raise InvalidCacheState(f"row {i}: keys {list(s.keys.shape)} and values {list(s.values.shape)} differ")
            if s.idx > s.keys.shape[2] or s.keys.shape[2] > max(s.offset, self.max_size):
                raise InvalidCacheState(
                    f"row {i}: ring head {s.idx}, buffer {s.keys.shape[2]}, offset {s.offset} are inconsistent "
                    f"for max_size {self.max_size}"
                )
            if s.offset < self.max_size and s.idx != s.offset:
                raise InvalidCacheState(f"row {i}: before the wrap the head {s.idx} must equal the offset {s.offset}")
        same = (s.offset, s.idx) == (ref.offset, ref.idx) and (s.keys is None) == (ref.keys is None)
        if same and s.keys is not None:
            same = all(
                a.shape == b.shape and a.dtype == b.dtype for a, b in ((s.keys, ref.keys), (s.values, ref.values))
            )
        if not same:
            raise InvalidCacheState(
                f"ring rows batch only when laid out alike: row {i} (offset {s.offset}, head {s.idx}) differs from "
                f"row 0 (offset {ref.offset}, head {ref.idx}) or in buffer shape"
            )

    def merge_row_states(self, states: Sequence[RingRowState]) -> None:
        """Replace this cache's contents with ``states`` as rows (they must share offset, head and buffer shape)."""
        states = list(states)
        if not states:
            raise InvalidCacheState("merge needs at least one row")
        for i, s in enumerate(states):
            self._check_state(i, s, states[0])
        first = states[0]
        self._reset()
        if first.keys is not None:
            many = len(states) > 1
            self._keys = mx.concatenate([s.keys for s in states], axis=0) if many else owned(first.keys)
            self._values = mx.concatenate([s.values for s in states], axis=0) if many else owned(first.values)
        self._batch = len(states)
        self._offset, self._idx = first.offset, first.idx
        self._minimum = max(s.minimum_reusable_offset for s in states)

    def merge_rows(self, rows: Sequence[RotatingKVCache]) -> None:
        def check(source: Any) -> None:
            if type(source) is not RotatingKVCache or (source.max_size, source.keep) != (self.max_size, self.keep):
                raise InvalidCacheState(
                    f"cannot merge {describe(source)} into a rotating cache of max_size {self.max_size}, "
                    f"keep {self.keep}"
                )

        def empty(source: RotatingKVCache) -> RingRowState:
            return RingRowState(None, None, 0, 0, source.minimum_reusable_offset)

        self.merge_row_states(source_row_states(rows, empty, check))

    def extract_row(self, row: int) -> RotatingKVCache:
        return extract_one_row(self, row)

    def filter_rows(self, keep: Sequence[int]) -> None:
        if self._batch is None:
            raise InvalidCacheState("filter_rows: this rotating cache holds no rows")
        keep = check_keep(keep, self._batch)
        if self._keys is not None:
            index = mx.array(keep, dtype=mx.int32)
            self._keys, self._values = mx.take(self._keys, index, axis=0), mx.take(self._values, index, axis=0)
        self._batch = len(keep)

    def dispose(self) -> None:
        self._reset()


__all__ = ["RingRowState", "RotatingKVCache"]
