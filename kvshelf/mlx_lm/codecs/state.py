"""mlx-lm's caches without a plain token axis <-> entries: ``RotatingKVCache`` (and one-row
``BatchRotatingKVCache``) as ``mlx-lm.rotating``, ``ArraysCache`` as ``mlx-lm.arrays``.

* ``mlx-lm.rotating``: once the ring has wrapped, the ring buffers ``[1, H, S, D]`` exactly as laid out (ring slot s
  is not position s, so no token axis), with ``max_size``, ``keep``, ``idx`` (mlx-lm's ``_idx``) and ``buffer`` in
  ``extra`` — kvshelf's rotating slot layout. A prefix exists only before the ring wraps (``offset < max_size``,
  mlx-lm's ``is_trimmable``) and is mlx-lm's ``trim``: offset and ``_idx`` drop, the buffers stay.
  Before it wraps (``rows`` in ``extra``): ``offset < max_size`` and ``_idx == offset`` — mlx-lm writes position p
  at slot p until the ring first turns (``_update_in_place`` grows the buffer and writes at ``_idx``;
  ``_update_concat`` appends after the live slots; ``trim`` moves both back) and, once it has turned or dropped a
  slot, ``offset - _idx`` never returns to 0 — so slot p *is* position p, and the planes are stored cut to the
  offset on token axis 2 like ``KVCache``'s (same names: the same rows are the same chunks). Why: stored whole, a
  grown session's save hashed and wrote the whole ring every time (1.6× mlx-lm's own re-save); with rows, it
  writes only the new rows, like the other classes. Restored, the buffer is ``buffer`` slots long again, zeros past
  the offset (mlx-lm never reads a slot at or past the offset before writing it). Snapshots stored whole still
  load: the layout is told by ``rows``, so no format change.
* ``mlx-lm.arrays``: one tensor per present slot (``slot.<j>``, no token axis), ``size`` and ``present`` in
  ``extra`` as kvshelf's arrays kind. mlx-lm's ``ArraysCache`` counts no positions, so its codec takes the length
  from the caller (``takes_length``: the store and ``save_snapshot`` pass ``len(tokens)``); recurrent state is
  reusable at exactly that length, never cut.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache, RotatingKVCache

from ...codecs import dtypes, validate
from ...codecs.header import CacheEntry
from ...codecs.kinds.kv import HEAD_KEYS, check_common, extra_dtype, extra_int
from ...codecs.kinds.kv_state import check_exact_prefix, present_slots
from ...codecs.kinds.latent_common import check_prefix, make_slots, prefix_tensors, replace_entry
from ...codecs.validate import SlotSpec
from ...errors import CacheRangeError, InvalidCacheState
from ..upstream import in_right_padded_prefill, set_write_index, write_index
from .base import MlxCodec, check_planes, python_int, require_one_row
from .kv import AXIS, grown


class RotatingCodec(MlxCodec):
    """``RotatingKVCache``: the whole ring, its head and window (see the module docstring)."""

    kind = "mlx-lm.rotating"
    cache_type = RotatingKVCache
    also_matches = (BatchRotatingKVCache,)
    _keys = frozenset({"max_size", "keep", "idx", "buffer", "dtype", "rows", *HEAD_KEYS})

    @staticmethod
    def unwrapped(offset: int, idx: int, max_size: int, buffer: int) -> bool:
        """Whether ring slot p holds position p for every p < offset (the module docstring says why this is exact)."""
        return offset < max_size and idx == offset and offset <= buffer

    def snapshot(self, cache: Any, *, checksums: bool = True, length: int | None = None
                 ) -> tuple[CacheEntry, list[mx.array]]:
        if isinstance(cache, BatchRotatingKVCache):
            cache = self._row_of(cache)
        offset = python_int(cache.offset, "RotatingKVCache.offset")
        extra: dict[str, Any] = {
            "max_size": python_int(cache.max_size, "RotatingKVCache.max_size"),
            "keep": python_int(cache.keep, "RotatingKVCache.keep"),
            "idx": python_int(write_index(cache), "RotatingKVCache._idx"),
        }
        arrays: list[mx.array] = []
        axis = None
        if cache.keys is not None:
            arrays = [cache.keys, cache.values]
            check_planes(self.kind, arrays)
            buffer = arrays[0].shape[2]
            extra.update(buffer=buffer, kv_heads=arrays[0].shape[1], k_head_dim=arrays[0].shape[3],
                         v_head_dim=arrays[1].shape[3], dtype=dtypes.dtype_name(arrays[0].dtype))
            if self.unwrapped(offset, extra["idx"], extra["max_size"], buffer):
                extra["rows"] = True
                axis = AXIS
                arrays = [a[:, :, :offset, :] if buffer != offset else a for a in arrays]
        elif offset:
            raise InvalidCacheState(f"RotatingKVCache offset {offset} but no keys or values")
        slots = make_slots([(n, a, axis) for n, a in zip(("keys", "values"), arrays)], checksums)
        entry = CacheEntry(kind=self.kind, offset=offset, tensors=slots, extra=extra)
        self.validate(entry)
        return entry, arrays

    @staticmethod
    def _row_of(batch: BatchRotatingKVCache) -> RotatingKVCache:
        require_one_row(batch.left_padding.reshape(-1, 1), "this BatchRotatingKVCache")
        if in_right_padded_prefill(batch):
            raise InvalidCacheState("this BatchRotatingKVCache is inside a right-padded prefill; call finalize() first")
        if batch.keys is None:
            return RotatingKVCache(batch.max_size)
        return batch.extract(0)

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        check_common(entry, index, self.kind, (), self._keys)
        max_size = extra_int(entry, index, "max_size")
        keep = extra_int(entry, index, "keep", 0)
        idx = extra_int(entry, index, "idx", 0)
        if keep > max_size:
            raise validate.incompatible(entry, index, "extra.keep", f"{keep} is above max_size {max_size}")
        if "buffer" not in entry.extra:
            if entry.offset or idx:
                raise validate.corrupt(entry, index, "extra.buffer", f"missing for offset {entry.offset}")
            validate.check_slots(entry, index, [])
            return
        buffer, heads = extra_int(entry, index, "buffer"), extra_int(entry, index, "kv_heads")
        dk, dv = extra_int(entry, index, "k_head_dim"), extra_int(entry, index, "v_head_dim")
        dtype = extra_dtype(entry, index)
        if idx > buffer:
            raise validate.corrupt(entry, index, "extra.idx", f"ring head {idx} is past the buffer of {buffer}")
        if "rows" in entry.extra:
            if entry.extra["rows"] is not True or not self.unwrapped(entry.offset, idx, max_size, buffer):
                raise validate.corrupt(entry, index, "extra.rows", f"rows of a ring that wrapped (offset "
                                       f"{entry.offset}, idx {idx}, max_size {max_size}, buffer {buffer})")
            validate.check_slots(entry, index, [SlotSpec("keys", dtype, (1, heads, entry.offset, dk), AXIS),
                                                SlotSpec("values", dtype, (1, heads, entry.offset, dv), AXIS)])
            return
        validate.check_slots(entry, index, [SlotSpec("keys", dtype, (1, heads, buffer, dk), None),
                                            SlotSpec("values", dtype, (1, heads, buffer, dv), None)])

    def _build(self, entry: CacheEntry, arrays: list[mx.array], index: int | None) -> RotatingKVCache:
        cache = RotatingKVCache(entry.extra["max_size"], keep=entry.extra["keep"])
        if arrays and entry.extra.get("rows"):
            cache.keys, cache.values = (grown(a, entry.extra["buffer"]) for a in arrays)
        elif arrays:
            cache.keys, cache.values = arrays
        cache.offset = entry.offset
        set_write_index(cache, entry.extra["idx"])
        return cache

    def header_trimmable(self, entry: CacheEntry) -> bool:
        return entry.offset < extra_int(entry, None, "max_size")

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_prefix(entry, p)
        if p == entry.offset:
            return entry
        if not self.header_trimmable(entry):
            raise CacheRangeError(f"the ring wrapped ({entry.offset} positions, max_size {entry.extra['max_size']}); "
                                  f"it has no prefix {p}")
        idx = entry.extra["idx"] - (entry.offset - p)
        if idx < 0:
            raise CacheRangeError(f"ring head {entry.extra['idx']} cannot move back {entry.offset - p} positions")
        if entry.extra.get("rows"):  # the first p rows, the buffer as it was (mlx-lm's trim keeps it)
            return replace_entry(entry, offset=p, tensors=prefix_tensors(entry, p), extra={**entry.extra, "idx": idx})
        return replace_entry(entry, offset=p, extra={**entry.extra, "idx": idx})


class ArraysCodec(MlxCodec):
    """``ArraysCache``: recurrent slots at the caller's length (see the module docstring)."""

    kind = "mlx-lm.arrays"
    cache_type = ArraysCache
    takes_length = True

    def snapshot(self, cache: ArraysCache, *, checksums: bool = True, length: int | None = None
                 ) -> tuple[CacheEntry, list[mx.array]]:
        if length is None:
            raise InvalidCacheState(
                "mlx-lm's ArraysCache counts no positions: give the number of tokens it encodes (length=...; "
                "store.save and save_snapshot pass len(tokens))"
            )
        length = python_int(length, "length")
        if cache.lengths is not None:
            raise InvalidCacheState("this ArraysCache is inside a batched prefill (lengths set); call finalize() first")
        slots = list(cache.cache)
        for j, array in enumerate(slots):
            if array is not None:
                if not isinstance(array, mx.array):
                    raise InvalidCacheState(f"ArraysCache slot {j} holds {type(array).__name__}, not an mlx array")
                require_one_row(array, f"ArraysCache slot {j}")
        extra: dict[str, Any] = {"size": len(slots), "present": "".join("0" if a is None else "1" for a in slots)}
        if cache.left_padding is not None:
            pads = cache.left_padding.reshape(-1).tolist()
            if len(pads) != 1:
                raise InvalidCacheState(f"this ArraysCache holds {len(pads)} rows; save each row on its own")
            extra["left_padding"] = int(pads[0])
        named = [(f"slot.{j}", a, None) for j, a in enumerate(slots) if a is not None]
        entry = CacheEntry(kind=self.kind, offset=length, tensors=make_slots(named, checksums), extra=extra)
        self.validate(entry)
        return entry, [a for _, a, _ in named]

    def _present(self, entry: CacheEntry, index: int | None) -> list[int]:
        return present_slots(entry, index)

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        check_common(entry, index, self.kind, (), {"size", "present", "left_padding"})
        if "left_padding" in entry.extra:
            extra_int(entry, index, "left_padding", -(2**31))
        present = self._present(entry, index)
        if len(entry.tensors) != len(present):
            raise validate.incompatible(entry, index, "tensors", f"{len(present)} present slots, "
                                        f"{len(entry.tensors)} tensors")
        specs = []
        for i, (j, slot) in enumerate(zip(present, entry.tensors)):
            if not dtypes.is_known(slot.dtype):
                raise validate.incompatible(entry, index, f"tensors[{i}].dtype", f"unknown dtype {slot.dtype!r}")
            if not slot.shape or slot.shape[0] != 1:
                raise validate.incompatible(entry, index, f"tensors[{i}].shape", "a row's slot is [1, ...]")
            specs.append(SlotSpec(f"slot.{j}", slot.dtype, tuple(slot.shape), None))
        validate.check_slots(entry, index, specs)

    def _build(self, entry: CacheEntry, arrays: list[mx.array], index: int | None) -> ArraysCache:
        cache = ArraysCache(entry.extra["size"])
        for j, array in zip(self._present(entry, index), arrays):
            cache[j] = array
        if "left_padding" in entry.extra:
            cache.left_padding = mx.array([entry.extra["left_padding"]])
        return cache

    def header_trimmable(self, entry: CacheEntry) -> bool:
        return False

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_exact_prefix(entry, p)
        return entry


STATE_CODECS = (RotatingCodec(), ArraysCodec())

__all__ = ["STATE_CODECS", "ArraysCodec", "RotatingCodec"]
