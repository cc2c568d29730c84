"""mlx-lm's token-axis caches <-> entries: ``KVCache`` (and one-row ``BatchKVCache``), ``ConcatenateKVCache``,
``QuantizedKVCache`` (kinds ``mlx-lm.kv``, ``mlx-lm.concat``, ``mlx-lm.qkv``) and ``ChunkedKVCache``
(``mlx-lm.chunked``).

The stored tensors are kvshelf's own key/value layout, slot for slot: planes ``[1, H, T, w]`` cut to the offset
(no spare capacity), token axis 2, named ``keys``/``values`` (plain) or ``keys.packed``/``keys.scales``/
``keys.biases``/``values.*`` (affine), with ``kv_heads``, ``k_head_dim``, ``v_head_dim`` and the model ``dtype`` in
``extra``. So a token range holds the same bytes under the same names whether it came from mlx-lm's ``KVCache`` or
kvshelf's, and the store's content-addressed chunks dedupe across the two. Only the kind differs (it says which
class comes back) and ``extra.capacity``: the length of mlx-lm's buffer, restored (zeros past the offset) so the
restored ``state`` has the shape the saved one had.

``ChunkedKVCache`` holds positions ``[start_position, offset)``; its columns are stored whole (no token axis) with
``start_position`` as the entry's floor, and a prefix is mlx-lm's own ``trim``: the offset drops, the buffer stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
)

from ...codecs import dtypes, validate
from ...codecs.batch_plan import BatchPlan, BatchTensor, RowSource, right_justified
from ...codecs.header import CacheEntry
from ...codecs.kinds.kv import HEAD_KEYS, check_common, extra_dtype, extra_int
from ...codecs.kinds.latent_common import check_prefix, make_slots, replace_entry
from ...codecs.validate import SlotSpec
from ...errors import InvalidCacheState
from ..upstream import in_right_padded_prefill, set_write_index
from .base import MAX_CAPACITY, MlxCodec, check_planes, python_int, require_one_row

AXIS = 2


def grown(plane: mx.array, capacity: int) -> mx.array:
    """``plane`` ``[1, H, T, w]`` followed by zero columns up to ``capacity`` (as mlx-lm's buffer holds them)."""
    extra = capacity - plane.shape[AXIS]
    if extra <= 0:
        return plane
    zeros = mx.zeros((*plane.shape[:AXIS], extra, plane.shape[3]), dtype=plane.dtype)
    return mx.concatenate([plane, zeros], axis=AXIS)


class TokenCodec(MlxCodec):
    """Planes ``[1, H, T, w]`` on token axis 2, cut to the offset; subclasses say how a cache holds them."""

    format_fields: tuple[str, ...] = ()
    has_capacity = True

    # -- per-kind vocabulary -----------------------------------------------------------------------------------
    def _planes(self, cache: Any) -> tuple[list[mx.array], int]:
        """The cache's buffers ``[1, H, S, w]`` in slot order ([] before the first append) and its offset."""
        raise NotImplementedError

    def _names(self) -> list[str]:
        return ["keys", "values"]

    def _head_dims(self, entry_fields: dict[str, Any], planes: list[mx.array]) -> tuple[int, int]:
        return planes[0].shape[3], planes[1].shape[3]

    def _fields(self, cache: Any) -> dict[str, Any]:
        return {}

    def _layout(self, entry: CacheEntry, index: int | None, dk: int, dv: int, dtype: str) -> list[tuple[str, str, int]]:
        return [("keys", dtype, dk), ("values", dtype, dv)]

    def _model_dtype(self, planes: list[mx.array]) -> mx.Dtype:
        return planes[0].dtype

    # -- the codec ---------------------------------------------------------------------------------------------
    def snapshot(self, cache: Any, *, checksums: bool = True, length: int | None = None
                 ) -> tuple[CacheEntry, list[mx.array]]:
        planes, offset = self._planes(cache)
        what = f"{self.kind} ({type(cache).__name__})"
        extra: dict[str, Any] = {}
        arrays: list[mx.array] = []
        fields = self._fields(cache)
        if planes:
            check_planes(what, planes)
            capacity = planes[0].shape[AXIS]
            if offset > capacity:
                raise InvalidCacheState(f"{what}: offset {offset} is past its buffer of {capacity} positions")
            arrays = [p[:, :, :offset, :] if capacity != offset else p for p in planes]
            dk, dv = self._head_dims(fields, planes)
            extra = {"kv_heads": planes[0].shape[1], "k_head_dim": dk, "v_head_dim": dv,
                     "dtype": dtypes.dtype_name(self._model_dtype(planes))}
            if self.has_capacity:
                extra["capacity"] = capacity
        elif offset:
            raise InvalidCacheState(f"{what}: offset {offset} but no keys or values")
        slots = make_slots([(n, a, AXIS) for n, a in zip(self._names(), arrays)], checksums)
        entry = CacheEntry(kind=self.kind, offset=offset, tensors=slots, extra=extra, **fields)
        self.validate(entry)
        return entry, arrays

    def _specs(self, entry: CacheEntry, index: int | None) -> list[SlotSpec]:
        if not entry.extra:
            if entry.offset:
                raise validate.incompatible(entry, index, "extra.kv_heads", f"missing for offset {entry.offset}")
            return []
        heads = extra_int(entry, index, "kv_heads")
        dk, dv = extra_int(entry, index, "k_head_dim"), extra_int(entry, index, "v_head_dim")
        dtype = extra_dtype(entry, index)
        if self.has_capacity:
            capacity = extra_int(entry, index, "capacity", 0)
            if not entry.offset <= capacity <= MAX_CAPACITY:
                raise validate.corrupt(entry, index, "extra.capacity",
                                       f"{capacity} is not within [offset {entry.offset}, {MAX_CAPACITY}]")
        return [SlotSpec(name, plane_dtype, (1, heads, self._stored(entry, index), width), self._axis())
                for name, plane_dtype, width in self._layout(entry, index, dk, dv, dtype)]

    def _stored(self, entry: CacheEntry, index: int | None) -> int:
        return entry.offset

    def _axis(self) -> int | None:
        return AXIS

    def _extra_keys(self) -> set[str]:
        return {*HEAD_KEYS, "dtype", *({"capacity"} if self.has_capacity else ())}

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        check_common(entry, index, self.kind, self.format_fields, self._extra_keys())
        validate.check_slots(entry, index, self._specs(entry, index))

    def _capacity(self, entry: CacheEntry) -> int:
        return int(entry.extra.get("capacity", entry.offset))

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        """The first ``p`` positions, in a buffer of mlx-lm's own step (``p`` rounded up to 256, at least one step,
        at most the saved buffer), not the saved buffer.

        Why: the saved capacity is the buffer of all ``T`` positions; a prefix restored into it allocated and
        zeroed ``T`` rows and copied the ``p`` read ones into them (``grown``), so ``restore_prefix`` of 1,024 of
        4,096 tokens cost about twice a full restore. mlx-lm's cache grows its buffer in steps of 256 on the next
        ``update_and_fetch`` anyway."""
        out = super().prefix_entry(entry, p)
        if self.has_capacity and "capacity" in out.extra:
            step = KVCache.step
            capacity = max(p, min(int(out.extra["capacity"]), max(1, -(-p // step)) * step))
            out = replace_entry(out, extra={**out.extra, "capacity": capacity})
        return out


class PlainCodec(TokenCodec):
    """``KVCache``; a one-row ``BatchKVCache`` is saved as the ``KVCache`` its ``extract(0)`` gives."""

    kind = "mlx-lm.kv"
    cache_type = KVCache
    also_matches = (BatchKVCache,)

    def _planes(self, cache: Any) -> tuple[list[mx.array], int]:
        if isinstance(cache, BatchKVCache):
            cache = self._row_of(cache)
        if cache.keys is None:
            return [], python_int(cache.offset, "KVCache.offset")
        return [cache.keys, cache.values], python_int(cache.offset, "KVCache.offset")

    @staticmethod
    def _row_of(batch: BatchKVCache) -> KVCache:
        require_one_row(batch.left_padding.reshape(-1, 1), "this BatchKVCache")
        if in_right_padded_prefill(batch):
            raise InvalidCacheState("this BatchKVCache is inside a right-padded prefill; call finalize() first")
        return batch.extract(0) if batch.keys is not None else KVCache()

    def _build(self, entry: CacheEntry, arrays: list[mx.array], index: int | None) -> KVCache:
        cache = KVCache()
        if arrays:
            capacity = self._capacity(entry)
            cache.keys, cache.values = (grown(a, capacity) for a in arrays)
        cache.offset = entry.offset
        return cache

    # -- the direct serial path: mlx-lm's own buffer, read in place ----------------------------------------------
    def row_plan(self, entry: CacheEntry) -> BatchPlan:
        """One restored ``KVCache``'s buffers as mlx-lm holds them: ``[1, H, capacity, w]`` planes with the
        ``offset`` stored positions at column 0 and zeros after. The store reads the chunks straight into them and
        ``adopt_row`` wraps them as they are.

        Why: loading through ``_build`` read ``[1, H, T, w]`` planes and then ``_grown`` concatenated them with
        the zero columns up to the capacity: a second full copy of every restored byte (2 GiB for a 64K-token
        session of 32 KiB per token; MLX's peak memory was twice the KV)."""
        if not entry.tensors:
            return BatchPlan(())
        capacity = max(self._capacity(entry), entry.offset)
        return BatchPlan(tuple(
            BatchTensor(t.name, t.dtype, (1, t.shape[1], capacity, t.shape[3]), AXIS, (RowSource(j, 0),))
            for j, t in enumerate(entry.tensors)
        ))

    def adopt_row(self, entry: CacheEntry, arrays: Sequence[mx.array]) -> KVCache:
        """The ``KVCache`` around ``row_plan(entry)``'s filled planes, without copying them (planes at least
        ``offset`` long, positions at column 0, as ``row_plan`` lays them out)."""
        arrays = list(arrays)
        cache = KVCache()
        if arrays:
            if len(arrays) != 2 or any(a.ndim != 4 or a.shape[0] != 1 or a.shape[AXIS] < entry.offset
                                       for a in arrays):
                raise InvalidCacheState(f"{self.kind}: adopt_row takes two [1, H, >= {entry.offset}, w] planes")
            cache.keys, cache.values = arrays
        cache.offset = entry.offset
        return cache

    # -- the direct batch path: mlx-lm's BatchKVCache.merge layout, written in place ---------------------------
    def _geometry(self, entries: list[CacheEntry]) -> list[tuple[str, int, int]] | None:
        shaped = [e for e in entries if e.tensors]
        if not shaped:
            return None
        template = [(t.dtype, t.shape[1], t.shape[3]) for t in shaped[0].tensors]
        for i, entry in enumerate(entries):
            if entry.tensors and [(t.dtype, t.shape[1], t.shape[3]) for t in entry.tensors] != template:
                raise InvalidCacheState(f"{self.kind}: row {i} has another head geometry or dtype than row 0; "
                                        "mlx-lm's BatchKVCache holds one")
        return template

    def batch_plan(self, entries: Sequence[CacheEntry]) -> BatchPlan:
        """Rows right-justified at the longest row's length ``W`` in ``[B, H, W, w]`` planes (no spare capacity),
        zeros before them: the layout ``BatchKVCache.merge`` builds."""
        entries = list(entries)
        self._check_batch(entries)
        template = self._geometry(entries)
        offsets = [e.offset for e in entries]
        width = max(offsets)
        if template is None or width == 0:
            return BatchPlan(())
        return BatchPlan(tuple(
            right_justified(name, dtype, (len(entries), heads, width, w), AXIS, width,
                            [j if e.tensors else None for e in entries], offsets)
            for j, (name, (dtype, heads, w)) in enumerate(zip(self._names(), template))
        ))

    def adopt_batch(self, entries: Sequence[CacheEntry], arrays: Sequence[mx.array]) -> BatchKVCache:
        entries, arrays = list(entries), list(arrays)
        offsets = [e.offset for e in entries]
        width = max(offsets)
        if not arrays:
            return BatchKVCache([0] * len(entries))
        if len(arrays) != 2 or any(a.shape[0] != len(entries) or a.shape[AXIS] != width for a in arrays):
            raise InvalidCacheState(f"{self.kind}: adopt_batch takes two [B, H, {width}, w] planes")
        cache = BatchKVCache([width - o for o in offsets])
        cache.keys, cache.values = arrays
        cache.offset += width
        set_write_index(cache, width)
        return cache

    def load_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], *,
                   verify: bool = True) -> BatchKVCache:
        self._check_batch(list(entries))
        self._geometry(list(entries))  # one clear message instead of mlx-lm's shape error inside merge
        return super().load_batch(entries, arrays_per_row, verify=verify)


class ConcatCodec(TokenCodec):
    """``ConcatenateKVCache``: its buffers are exactly the live positions, so no capacity is recorded."""

    kind = "mlx-lm.concat"
    cache_type = ConcatenateKVCache
    has_capacity = False

    def _planes(self, cache: ConcatenateKVCache) -> tuple[list[mx.array], int]:
        offset = python_int(cache.offset, "ConcatenateKVCache.offset")
        return ([] if cache.keys is None else [cache.keys, cache.values]), offset

    def _build(self, entry: CacheEntry, arrays: list[mx.array], index: int | None) -> ConcatenateKVCache:
        cache = ConcatenateKVCache()
        if arrays:
            cache.keys, cache.values = arrays
        cache.offset = entry.offset
        return cache


class QuantizedCodec(TokenCodec):
    """``QuantizedKVCache``: mlx-lm's affine triples (packed uint32, scales, biases) per keys and values."""

    kind = "mlx-lm.qkv"
    cache_type = QuantizedKVCache
    format_fields = ("bits", "group_size")

    def _names(self) -> list[str]:
        return [f"{who}.{n}" for who in ("keys", "values") for n in ("packed", "scales", "biases")]

    def _planes(self, cache: QuantizedKVCache) -> tuple[list[mx.array], int]:
        offset = python_int(cache.offset, "QuantizedKVCache.offset")
        if cache.keys is None:
            return [], offset
        planes = [*cache.keys, *cache.values]
        if len(cache.keys) != 3 or len(cache.values) != 3 or any(p is None for p in planes):
            raise InvalidCacheState("QuantizedKVCache keys and values must each be (packed, scales, biases)")
        return planes, offset

    def _fields(self, cache: QuantizedKVCache) -> dict[str, Any]:
        return {"bits": python_int(cache.bits, "QuantizedKVCache.bits"),
                "group_size": python_int(cache.group_size, "QuantizedKVCache.group_size")}

    def _head_dims(self, fields: dict[str, Any], planes: list[mx.array]) -> tuple[int, int]:
        return planes[1].shape[3] * fields["group_size"], planes[4].shape[3] * fields["group_size"]

    def _model_dtype(self, planes: list[mx.array]) -> mx.Dtype:
        return planes[1].dtype

    def _layout(self, entry, index, dk, dv, dtype):
        bits, group = entry.bits, entry.group_size
        out = []
        for who, dim in (("keys", dk), ("values", dv)):
            if dim % group or (dim * bits) % 32:
                raise validate.incompatible(entry, index, f"extra.{who[0]}_head_dim",
                                            f"{dim} does not split into groups of {group} at {bits} bits")
            out += [(f"{who}.packed", "uint32", dim * bits // 32), (f"{who}.scales", dtype, dim // group),
                    (f"{who}.biases", dtype, dim // group)]
        return out

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        check_common(entry, index, self.kind, self.format_fields, self._extra_keys())
        if entry.bits not in (2, 3, 4, 5, 6, 8) or entry.group_size not in (32, 64, 128):
            raise validate.incompatible(entry, index, "bits/group_size",
                                        f"mlx.quantize takes no bits={entry.bits} group_size={entry.group_size}")
        validate.check_slots(entry, index, self._specs(entry, index))

    def _build(self, entry: CacheEntry, arrays: list[mx.array], index: int | None) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=entry.group_size, bits=entry.bits)
        if arrays:
            capacity = self._capacity(entry)
            planes = [grown(a, capacity) for a in arrays]
            cache.keys, cache.values = tuple(planes[:3]), tuple(planes[3:])
        cache.offset = entry.offset
        return cache


class ChunkedCodec(TokenCodec):
    """``ChunkedKVCache`` (llama4): the live columns ``[start_position, offset)`` stored whole."""

    kind = "mlx-lm.chunked"
    cache_type = ChunkedKVCache

    def _extra_keys(self) -> set[str]:
        return {*super()._extra_keys(), "chunk_size", "start_position", "stored"}

    def _axis(self) -> int | None:
        return None

    def _stored(self, entry: CacheEntry, index: int | None) -> int:
        return extra_int(entry, index, "stored", 0)

    def snapshot(self, cache: ChunkedKVCache, *, checksums: bool = True, length: int | None = None
                 ) -> tuple[CacheEntry, list[mx.array]]:
        offset = python_int(cache.offset, "ChunkedKVCache.offset")
        start = python_int(cache.start_position, "ChunkedKVCache.start_position")
        chunk = python_int(cache.chunk_size, "ChunkedKVCache.chunk_size")
        if start > offset:
            raise InvalidCacheState(f"ChunkedKVCache start_position {start} is past its offset {offset}")
        extra: dict[str, Any] = {"chunk_size": chunk, "start_position": start}
        arrays: list[mx.array] = []
        if cache.keys is not None:
            planes = [cache.keys, cache.values]
            check_planes(self.kind, planes)
            live = offset - start
            if live > planes[0].shape[AXIS]:
                raise InvalidCacheState(f"ChunkedKVCache holds {planes[0].shape[AXIS]} columns, needs {live}")
            arrays = [p[:, :, :live, :] for p in planes]
            extra.update(kv_heads=planes[0].shape[1], k_head_dim=planes[0].shape[3], v_head_dim=planes[1].shape[3],
                         dtype=dtypes.dtype_name(planes[0].dtype), capacity=planes[0].shape[AXIS], stored=live)
        elif offset:
            raise InvalidCacheState(f"ChunkedKVCache offset {offset} but no keys or values")
        slots = make_slots([(n, a, None) for n, a in zip(self._names(), arrays)], checksums)
        entry = CacheEntry(kind=self.kind, offset=offset, minimum_reusable_offset=start, tensors=slots, extra=extra)
        self.validate(entry)
        return entry, arrays

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        check_common(entry, index, self.kind, (), self._extra_keys())
        extra_int(entry, index, "chunk_size")
        start = extra_int(entry, index, "start_position", 0)
        if entry.minimum_reusable_offset != start:
            raise validate.corrupt(entry, index, "minimum_reusable_offset", f"must equal start_position {start}")
        specs = []
        if "kv_heads" in entry.extra:
            stored = self._stored(entry, index)
            if not entry.offset - start <= stored <= extra_int(entry, index, "capacity", 0):
                raise validate.corrupt(entry, index, "extra.stored",
                                       f"{stored} columns cannot hold positions [{start}, {entry.offset})")
            specs = self._specs(entry, index)
        elif entry.offset != start:
            raise validate.incompatible(entry, index, "extra.kv_heads", f"missing for offset {entry.offset}")
        validate.check_slots(entry, index, specs)

    def _specs(self, entry: CacheEntry, index: int | None) -> list[SlotSpec]:
        heads = extra_int(entry, index, "kv_heads")
        dk, dv = extra_int(entry, index, "k_head_dim"), extra_int(entry, index, "v_head_dim")
        dtype = extra_dtype(entry, index)
        stored = self._stored(entry, index)
        return [SlotSpec("keys", dtype, (1, heads, stored, dk), None),
                SlotSpec("values", dtype, (1, heads, stored, dv), None)]

    def _build(self, entry: CacheEntry, arrays: list[mx.array], index: int | None) -> ChunkedKVCache:
        cache = ChunkedKVCache(entry.extra["chunk_size"])
        cache.start_position = entry.extra["start_position"]
        if arrays:
            capacity = self._capacity(entry)
            cache.keys, cache.values = (grown(a, capacity) for a in arrays)
        cache.offset = entry.offset
        return cache

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        """mlx-lm's ``trim``: the offset drops to ``p`` (not below ``start_position``), the stored columns stay."""
        check_prefix(entry, p)
        return replace_entry(entry, offset=p)


TOKEN_CODECS = (PlainCodec(), ConcatCodec(), QuantizedCodec(), ChunkedCodec())

__all__ = ["AXIS", "TOKEN_CODECS", "ChunkedCodec", "ConcatCodec", "PlainCodec", "QuantizedCodec", "grown"]
