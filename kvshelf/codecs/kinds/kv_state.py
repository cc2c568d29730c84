"""Key/value legos whose state has no token axis <-> entries of kinds ``rotating`` and ``arrays``.

* ``rotating``: the whole ring ``[1, H, S, D]`` as laid out (no token axis: ring slot s is not position s), with
  ``max_size``, ``keep``, ``idx`` and ``buffer`` in ``extra``. A prefix exists only before the ring wraps.
* ``arrays``: one tensor per present slot (``slot.<j>``, no token axis); ``extra`` has ``size`` and ``present``
  (one 0/1 character per slot). Recurrent state has no prefix: it is reusable at its exact length only.

Kept apart from ``kv_codecs`` (the token-axis kinds) so each file holds one layout family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ...errors import CacheRangeError, InvalidCacheState
from ...latent_legos.kv import ArraysCache, RotatingKVCache
from ...latent_legos.kv.arrays import ArraysRowState
from ...latent_legos.kv.rotating import RingRowState
from .. import dtypes, validate
from ..header import CacheEntry
from .kv import HEAD_KEYS, check_common, extra_dtype, extra_int
from .latent_common import (
    RowStateCodec,
    check_prefix,
    check_rows,
    make_slots,
    prefix_tensors,
    replace_entry,
    require_serial,
    snapshot_floor,
)
from ..validate import SlotSpec


class RotatingKvCodec(RowStateCodec):
    """The ring as laid out: whole ``[1, H, S, D]`` buffers, no token axis; a prefix exists only before the wrap."""

    kind = "rotating"
    _keys = {"max_size", "keep", "idx", "buffer", "dtype", *HEAD_KEYS}

    def __repr__(self) -> str:
        return "RotatingKvCodec('rotating')"

    def matches(self, cache: object) -> bool:
        return type(cache) is RotatingKVCache

    def snapshot(self, cache: RotatingKVCache, *, checksums: bool = True) -> tuple[CacheEntry, list[mx.array]]:
        require_serial(cache, self)
        extra: dict[str, Any] = {"max_size": cache.max_size, "keep": cache.keep, "idx": 0}
        arrays: list[mx.array] = []
        offset = floor = 0
        if cache.batch_size is not None:
            state = cache.row_state(0)
            offset, floor = state.offset, snapshot_floor(state.minimum_reusable_offset, state.offset)
            extra["idx"] = state.idx
            if state.keys is not None:
                arrays = [state.keys, state.values]
                extra.update(
                    buffer=state.keys.shape[2], kv_heads=state.keys.shape[1], k_head_dim=state.keys.shape[3],
                    v_head_dim=state.values.shape[3], dtype=dtypes.dtype_name(state.keys.dtype),
                )
        slots = make_slots([(name, a, None) for name, a in zip(("keys", "values"), arrays)], checksums)
        entry = CacheEntry(kind=self.kind, offset=offset, minimum_reusable_offset=floor, tensors=slots, extra=extra)
        self.validate(entry)
        return entry, arrays

    def _ring(self, entry: CacheEntry, index: int | None) -> tuple[int, int, int]:
        max_size = extra_int(entry, index, "max_size")
        keep = extra_int(entry, index, "keep", 0)
        idx = extra_int(entry, index, "idx", 0)
        if keep >= max_size:
            raise validate.incompatible(entry, index, "extra.keep", f"{keep} must be below max_size {max_size}")
        return max_size, keep, idx

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        validate.require_entry(entry)
        check_common(entry, index, self.kind, (), self._keys)
        max_size, _, idx = self._ring(entry, index)
        if "buffer" not in entry.extra:
            if entry.offset or idx:
                raise validate.corrupt(entry, index, "extra.buffer", f"missing for offset {entry.offset}")
            validate.check_slots(entry, index, [])
            return
        buffer, heads = extra_int(entry, index, "buffer"), extra_int(entry, index, "kv_heads", maximum=validate.MAX_HEADS)
        dk = extra_int(entry, index, "k_head_dim", maximum=validate.MAX_HEAD_DIM)
        dv = extra_int(entry, index, "v_head_dim", maximum=validate.MAX_HEAD_DIM)
        dtype = extra_dtype(entry, index)
        if idx > buffer or buffer > max(entry.offset, max_size):
            raise validate.corrupt(
                entry, index, "extra.idx",
                f"head {idx}, buffer {buffer}, offset {entry.offset} are inconsistent for max_size {max_size}",
            )
        if entry.offset < max_size and idx != entry.offset:
            raise validate.corrupt(entry, index, "extra.idx", f"before the wrap the head {idx} must equal the offset")
        validate.check_slots(entry, index, [
            SlotSpec("keys", dtype, (1, heads, buffer, dk), None),
            SlotSpec("values", dtype, (1, heads, buffer, dv), None),
        ])

    def _state_of(self, entry: CacheEntry, arrays: Sequence[mx.array], index: int | None) -> RingRowState:
        keys, values = (arrays[0], arrays[1]) if arrays else (None, None)
        return RingRowState(keys, values, entry.offset, entry.extra["idx"], entry.minimum_reusable_offset)

    def _empty(self, entry: CacheEntry, index: int | None) -> RotatingKVCache:
        max_size, keep, _ = self._ring(entry, index)
        return RotatingKVCache(max_size, keep)

    def _check_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]]) -> None:
        check_rows(entries, arrays_per_row, self.kind, ())

    def _batch_cache(self, entries: Sequence[CacheEntry]) -> RotatingKVCache:
        max_size, keep, _ = self._ring(entries[0], 0)
        for i, entry in enumerate(entries):
            if self._ring(entry, i)[:2] != (max_size, keep):
                raise InvalidCacheState(f"rotating: row {i} has another max_size/keep than row 0")
        return RotatingKVCache(max_size, keep)

    def header_trimmable(self, entry: CacheEntry) -> bool:
        validate.require_entry(entry)
        return entry.offset < extra_int(entry, None, "max_size")

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_prefix(entry, p)
        if p < entry.offset and not self.header_trimmable(entry):
            raise CacheRangeError(
                f"the ring wrapped ({entry.offset} positions, max_size {entry.extra['max_size']}); it has no prefix {p}"
            )
        extra = dict(entry.extra)
        if p < entry.offset:
            extra["idx"] = p
        return replace_entry(entry, offset=p, tensors=prefix_tensors(entry, p), extra=extra)


def present_slots(entry: CacheEntry, index: int | None) -> list[int]:
    """Which of an arrays-cache entry's ``extra.size`` slots hold an array (``extra.present``, a 0/1 string): the
    one reading of that field, shared by kvshelf's ``ArraysCache`` codec and mlx-lm's."""
    size = extra_int(entry, index, "size")
    present = entry.extra.get("present")
    if not isinstance(present, str) or len(present) != size or set(present) - {"0", "1"}:
        message = f"expected {size} characters of 0/1, got {present!r}"
        raise validate.incompatible(entry, index, "extra.present", message)
    return [j for j, c in enumerate(present) if c == "1"]


class ArraysCodec(RowStateCodec):
    """Recurrent slots, one tensor per present slot, no token axis; reusable at the exact length only."""

    kind = "arrays"

    def __repr__(self) -> str:
        return "ArraysCodec('arrays')"

    def matches(self, cache: object) -> bool:
        return type(cache) is ArraysCache

    def snapshot(self, cache: ArraysCache, *, checksums: bool = True) -> tuple[CacheEntry, list[mx.array]]:
        require_serial(cache, self)
        slots: list[mx.array | None] = [None] * cache.size_slots
        offset = floor = 0
        if cache.batch_size is not None:
            state = cache.row_state(0)
            slots, offset = state.slots, state.offset
            floor = snapshot_floor(state.minimum_reusable_offset, offset)
        present = "".join("0" if a is None else "1" for a in slots)
        named = [(f"slot.{j}", a, None) for j, a in enumerate(slots) if a is not None]
        entry = CacheEntry(
            kind=self.kind, offset=offset, minimum_reusable_offset=floor, tensors=make_slots(named, checksums),
            extra={"size": cache.size_slots, "present": present},
        )
        self.validate(entry)
        return entry, [a for _, a, _ in named]

    def _present(self, entry: CacheEntry, index: int | None) -> list[int]:
        return present_slots(entry, index)

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        validate.require_entry(entry)
        check_common(entry, index, self.kind, (), {"size", "present"})
        present = self._present(entry, index)
        specs = []
        for j, slot in zip(present, entry.tensors):
            if not dtypes.is_known(slot.dtype):
                field = f"tensors[{len(specs)}].dtype"
                raise validate.incompatible(entry, index, field, f"unknown dtype {slot.dtype!r}")
            if not slot.shape or slot.shape[0] != 1:
                raise validate.incompatible(entry, index, f"tensors[{len(specs)}].shape", "a row's slot is [1, ...]")
            specs.append(SlotSpec(f"slot.{j}", slot.dtype, tuple(slot.shape), None))
        if len(entry.tensors) != len(present):
            message = f"{len(present)} present slots, {len(entry.tensors)} tensors"
            raise validate.incompatible(entry, index, "tensors", message)
        validate.check_slots(entry, index, specs)

    def _state_of(self, entry: CacheEntry, arrays: Sequence[mx.array], index: int | None) -> ArraysRowState:
        slots: list[mx.array | None] = [None] * entry.extra["size"]
        for j, array in zip(self._present(entry, index), arrays):
            slots[j] = array
        return ArraysRowState(slots, entry.offset, entry.minimum_reusable_offset)

    def _empty(self, entry: CacheEntry, index: int | None) -> ArraysCache:
        return ArraysCache(entry.extra["size"])

    def _check_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]]) -> None:
        check_rows(entries, arrays_per_row, self.kind, ())

    def _batch_cache(self, entries: Sequence[CacheEntry]) -> ArraysCache:
        sizes = {e.extra["size"] for e in entries}
        if len(sizes) != 1:
            raise InvalidCacheState(f"arrays: rows have different slot counts {sorted(sizes)}")
        return ArraysCache(sizes.pop())

    def header_trimmable(self, entry: CacheEntry) -> bool:
        return False

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_exact_prefix(entry, p)
        return replace_entry(entry, tensors=prefix_tensors(entry, p))



def check_exact_prefix(entry: CacheEntry, p: int) -> None:
    """A recurrent state has one prefix: its whole self (``CacheRangeError`` for any other length)."""
    check_prefix(entry, p)
    if p != entry.offset:
        raise CacheRangeError(f"recurrent state of {entry.offset} positions has no prefix {p} (exact length only)")

STATE_KV_CODECS = (RotatingKvCodec(), ArraysCodec())

__all__ = ["STATE_KV_CODECS", "ArraysCodec", "RotatingKvCodec", "check_exact_prefix", "present_slots"]
