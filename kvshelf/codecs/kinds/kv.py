"""Key/value legos <-> entries of kinds ``kv``, ``qkv`` and ``turboquant`` (``rotating`` and ``arrays``, whose state
has no token axis, are in ``kv_state_codecs``), and the head-geometry helpers both modules share.

Head geometry rides in ``CacheEntry.extra``: ``kv_heads``, ``k_head_dim``, ``v_head_dim`` and (plain and affine
kinds) the model ``dtype``. A cache that never saw an append has no head geometry: it snapshots as offset 0 with no
tensors and loads as an empty cache.

* ``kv`` / ``qkv`` / ``turboquant``: planes ``[1, H, T, w]`` cut to the offset, token axis 2. Groups of every
  quantized kind run along the head dim, so a token-axis cut is byte-safe and any prefix is a valid state.
* ``rotating``: the whole ring ``[1, H, S, D]`` as laid out (no token axis: ring slot s is not position s), with
  ``max_size``, ``keep``, ``idx`` and ``buffer`` in ``extra``. A prefix exists only before the ring wraps.
* ``arrays``: one tensor per present slot (``slot.<j>``, no token axis); ``extra`` has ``size`` and ``present``
  (one 0/1 character per slot). Recurrent state has no prefix: it is reusable at its exact length only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ...errors import KvShelfError
from ...latent_legos.encodings.turboquant import packed_dim
from ...latent_legos.formats import AffineFormat, TurboFormat
from ...latent_legos.kv import KvRowState, KVCache, QuantizedKVCache, TurboQuantKVCache
from ...latent_legos.kv.turbo import HEAD_DIMS
from .. import dtypes, validate
from ..batch_plan import BatchPlan, right_justified
from ..header import CacheEntry
from .latent_common import (
    RowStateCodec,
    check_rows,
    make_slots,
    require_serial,
    snapshot_floor,
)
from ..validate import SlotSpec

KV_DTYPES = ("float16", "bfloat16", "float32")
HEAD_KEYS = ("kv_heads", "k_head_dim", "v_head_dim")
_LATENT_FIELDS = ("kv_lora_rank", "rope_head_dim", "index_head_dim", "max_tokens", "pages")


def extra_int(entry: CacheEntry, index: int | None, key: str, minimum: int = 1,
              maximum: int | None = None) -> int:
    """An integer of ``extra`` within ``[minimum, maximum]`` (default maximum: ``validate.MAX_POSITIONS``, so a
    crafted ring ``max_size`` of 2**62 is refused before a cache is sized from it)."""
    value = entry.extra.get(key)
    top = validate.MAX_POSITIONS if maximum is None else maximum
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= top:
        raise validate.incompatible(entry, index, f"extra.{key}",
                                    f"expected an integer in [{minimum}, {top}], got {value!r}")
    return value


def extra_dtype(entry: CacheEntry, index: int | None) -> str:
    value = entry.extra.get("dtype")
    if value not in KV_DTYPES:
        raise validate.incompatible(entry, index, "extra.dtype", f"expected one of {KV_DTYPES}, got {value!r}")
    return value


def check_common(entry: CacheEntry, index: int | None, kind: str, fields: Sequence[str], extra_keys: set[str]) -> None:
    """Kind, no latent/paged fields, no format fields but ``fields``, no unknown extra keys, floor <= offset."""
    if entry.kind != kind:
        raise validate.incompatible(entry, index, "kind", f"expected {kind!r}")
    for field in (*_LATENT_FIELDS, *(f for f in ("bits", "group_size", "k_bits", "v_bits") if f not in fields)):
        if getattr(entry, field) is not None:
            raise validate.incompatible(entry, index, field, f"a {kind} entry has no {field}")
    for field in fields:
        if getattr(entry, field) is None:
            raise validate.incompatible(entry, index, field, f"a {kind} entry needs {field}")
    if entry.shadow or entry.quantized_kv_start:
        raise validate.incompatible(entry, index, "shadow/quantized_kv_start", f"a {kind} entry has neither")
    unknown = set(entry.extra) - extra_keys
    if unknown:
        raise validate.incompatible(entry, index, "extra", f"unknown keys {sorted(unknown)} for kind {kind!r}")
    validate.check_positions(entry, index, None)


class TokenKvCodec(RowStateCodec):
    """The token-axis kinds: planes ``[1, H, T, w]`` of a ``TokenRows`` cache, token axis 2."""

    kind: str
    cache_type: type
    format_fields: tuple[str, ...] = ()
    has_dtype = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r})"

    def matches(self, cache: object) -> bool:
        return type(cache) is self.cache_type

    # -- per-kind vocabulary ---------------------------------------------------------------------------------------
    def new_cache(self, entry: CacheEntry, index: int | None) -> Any:
        raise NotImplementedError

    def fields_of(self, cache: Any) -> dict[str, Any]:
        return {}

    def head_dims(self, cache: Any, planes: list[mx.array]) -> tuple[int, int]:
        raise NotImplementedError

    def plane_layout(self, entry: CacheEntry, index: int | None, dk: int, dv: int, dtype: str | None):
        """``(name, dtype, width)`` per plane for this entry's format and head dims."""
        raise NotImplementedError

    # -- the codec -------------------------------------------------------------------------------------------------
    def snapshot(self, cache: Any, *, checksums: bool = True) -> tuple[CacheEntry, list[mx.array]]:
        require_serial(cache, self)
        extra: dict[str, Any] = {}
        arrays: list[mx.array] = []
        offset = floor = 0
        if cache.batch_size is not None:
            cache._require_rows("snapshot")
            state = cache.row_state(0)
            offset, floor = state.offset, snapshot_floor(state.minimum_reusable_offset, state.offset)
            arrays = list(state.planes)
        if arrays:
            dk, dv = self.head_dims(cache, arrays)
            extra = {"kv_heads": arrays[0].shape[1], "k_head_dim": dk, "v_head_dim": dv}
            if self.has_dtype:
                extra["dtype"] = dtypes.dtype_name(arrays[0 if self.kind == "kv" else 1].dtype)  # model dtype
        names = [name for name, _, _ in self.plane_layout(None, None, 0, 0, None)] if arrays else []
        slots = make_slots([(name, array, 2) for name, array in zip(names, arrays)], checksums)
        entry = CacheEntry(
            kind=self.kind, offset=offset, minimum_reusable_offset=floor, tensors=slots, extra=extra,
            **self.fields_of(cache),
        )
        self.validate(entry)
        return entry, arrays

    def specs(self, entry: CacheEntry, index: int | None) -> list[SlotSpec]:
        if not any(k in entry.extra for k in (*HEAD_KEYS, "dtype")):
            if entry.offset:
                raise validate.incompatible(entry, index, "extra.kv_heads", f"missing for offset {entry.offset}")
            return []
        heads = extra_int(entry, index, "kv_heads", maximum=validate.MAX_HEADS)
        dk = extra_int(entry, index, "k_head_dim", maximum=validate.MAX_HEAD_DIM)
        dv = extra_int(entry, index, "v_head_dim", maximum=validate.MAX_HEAD_DIM)
        dtype = extra_dtype(entry, index) if self.has_dtype else None
        return [
            SlotSpec(name, plane_dtype, (1, heads, entry.offset, width), 2)
            for name, plane_dtype, width in self.plane_layout(entry, index, dk, dv, dtype)
        ]

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        validate.require_entry(entry)
        keys = set(HEAD_KEYS) | ({"dtype"} if self.has_dtype else set())
        check_common(entry, index, self.kind, self.format_fields, keys)
        validate.check_slots(entry, index, self.specs(entry, index))

    def _state_of(self, entry: CacheEntry, arrays: Sequence[mx.array], index: int | None) -> KvRowState:
        return KvRowState(list(arrays), entry.offset, entry.minimum_reusable_offset)

    def _empty(self, entry: CacheEntry, index: int | None) -> Any:
        return self.new_cache(entry, index)

    def _check_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]]) -> None:
        check_rows(entries, arrays_per_row, self.kind, ("bits", "group_size", "k_bits", "v_bits"))

    def _plan(self, entries: list[CacheEntry]) -> BatchPlan | None:
        """Rows right-justified at the batch width inside ``[B, H, capacity, w]`` planes, as ``merge_row_states``
        lays them; rows without head geometry (never appended to) stay zero. Rows whose head geometry differs
        have no plan: ``load_batch`` refuses them with its own message."""
        shaped = [e for e in entries if e.tensors]
        if not shaped:
            return BatchPlan(())
        template = shaped[0].tensors
        if any([(t.dtype, t.shape[1], t.shape[3]) for t in e.tensors] !=
               [(t.dtype, t.shape[1], t.shape[3]) for t in template] for e in shaped):
            return None
        offsets = [e.offset for e in entries]
        width, rows = max(offsets), len(entries)
        step = self.cache_type.step
        capacity = (width + step) // step * step
        return BatchPlan(tuple(
            right_justified(t.name, t.dtype, (rows, t.shape[1], capacity, t.shape[3]), 2, width,
                            [j if e.tensors else None for e in entries], offsets)
            for j, t in enumerate(template)
        ))

    def _adopt(self, cache: Any, entries: list[CacheEntry], arrays: list[mx.array]) -> None:
        cache.adopt_batch(arrays, [e.offset for e in entries], max(e.minimum_reusable_offset for e in entries))


class PlainKvCodec(TokenKvCodec):
    kind = "kv"
    cache_type = KVCache

    def new_cache(self, entry: CacheEntry, index: int | None) -> KVCache:
        return KVCache()

    def head_dims(self, cache: KVCache, planes: list[mx.array]) -> tuple[int, int]:
        return planes[0].shape[3], planes[1].shape[3]

    def plane_layout(self, entry, index, dk, dv, dtype):
        return [("keys", dtype, dk), ("values", dtype, dv)]


class AffineKvCodec(TokenKvCodec):
    kind = "qkv"
    cache_type = QuantizedKVCache
    format_fields = ("bits", "group_size")

    def _format(self, entry: CacheEntry, index: int | None) -> AffineFormat:
        try:
            return AffineFormat(entry.bits, entry.group_size)
        except KvShelfError as exc:
            raise validate.incompatible(entry, index, "bits/group_size", str(exc)) from None

    def new_cache(self, entry: CacheEntry, index: int | None) -> QuantizedKVCache:
        fmt = self._format(entry, index)
        return QuantizedKVCache(group_size=fmt.group_size, bits=fmt.bits)

    def fields_of(self, cache: QuantizedKVCache) -> dict[str, Any]:
        return {"bits": cache.bits, "group_size": cache.group_size}

    def head_dims(self, cache: QuantizedKVCache, planes: list[mx.array]) -> tuple[int, int]:
        return planes[1].shape[3] * cache.group_size, planes[4].shape[3] * cache.group_size

    def plane_layout(self, entry, index, dk, dv, dtype):
        if entry is None:
            names = ("packed", "scales", "biases")
            return [(f"{who}.{n}", None, 0) for who in ("keys", "values") for n in names]
        fmt = self._format(entry, index)
        out = []
        for who, dim in (("keys", dk), ("values", dv)):
            if dim % fmt.group_size or (dim * fmt.bits) % 32:
                raise validate.incompatible(
                    entry, index, f"extra.{who[0]}_head_dim",
                    f"{dim} does not split into groups of {fmt.group_size} at {fmt.bits} bits",
                )
            groups = dim // fmt.group_size
            out += [(f"{who}.packed", "uint32", dim * fmt.bits // 32), (f"{who}.scales", dtype, groups),
                    (f"{who}.biases", dtype, groups)]
        return out


class TurboKvCodec(TokenKvCodec):
    kind = "turboquant"
    cache_type = TurboQuantKVCache
    format_fields = ("k_bits", "v_bits")
    has_dtype = False

    def _format(self, entry: CacheEntry, index: int | None) -> TurboFormat:
        try:
            return TurboFormat(entry.k_bits, entry.v_bits)
        except KvShelfError as exc:
            raise validate.incompatible(entry, index, "k_bits/v_bits", str(exc)) from None

    def new_cache(self, entry: CacheEntry, index: int | None) -> TurboQuantKVCache:
        fmt = self._format(entry, index)
        return TurboQuantKVCache(fmt.k_bits, fmt.v_bits)

    def fields_of(self, cache: TurboQuantKVCache) -> dict[str, Any]:
        return {"k_bits": cache.k_bits, "v_bits": cache.v_bits}

    def head_dims(self, cache: TurboQuantKVCache, planes: list[mx.array]) -> tuple[int, int]:
        return planes[1].shape[3] * 32, planes[4].shape[3] * 32

    def plane_layout(self, entry, index, dk, dv, dtype):
        names = ("keys.codes", "keys.scales", "keys.zeros", "values.codes", "values.scales")
        if entry is None:
            return [(n, None, 0) for n in names]
        fmt = self._format(entry, index)
        for key, dim in (("k_head_dim", dk), ("v_head_dim", dv)):
            if dim not in HEAD_DIMS:
                raise validate.incompatible(entry, index, f"extra.{key}", f"{dim} is not one of {HEAD_DIMS}")
        code_dtype = "int8" if fmt.k_bits == 8 else "uint8"
        return [
            (names[0], code_dtype, packed_dim(dk, fmt.k_bits)), (names[1], "float16", dk // 32),
            (names[2], "float16", dk // 32), (names[3], "uint8", packed_dim(dv, fmt.v_bits)),
            (names[4], "float16", dv // 32),
        ]


TOKEN_KV_CODECS = (PlainKvCodec(), AffineKvCodec(), TurboKvCodec())

__all__ = ["HEAD_KEYS", "KV_DTYPES", "TOKEN_KV_CODECS", "AffineKvCodec", "PlainKvCodec", "TurboKvCodec", "check_common",
           "extra_dtype", "extra_int"]
