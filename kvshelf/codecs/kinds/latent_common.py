"""What the codecs share: geometry and format fields, slot layouts, serial-row checks, prefix cuts, row-state loads.

The three latent kinds differ only in which tensors they hold; the header vocabulary (geometry, format, floor) and
the way header values become library objects are the same, so header errors read the same for every kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import mlx.core as mx
import msgspec

from ...errors import IncompatibleFormat, InvalidCacheState, KvShelfError
from ...latent_legos.encodings import family_encoding
from ...latent_legos.formats import AffineFormat, TurboFormat
from ...latent_legos.latent.geometry import LatentGeometry
from .. import dtypes, validate
from ..batch_plan import BatchPlan
from ..checksum import checksum
from ..header import CacheEntry, TensorSlot

FAMILIES = ("latent", "rope", "index")

LatentFormat = AffineFormat | TurboFormat


def family_names(geometry: LatentGeometry) -> tuple[str, ...]:
    return FAMILIES[: len(geometry.widths)]


def geometry_fields(geometry: LatentGeometry) -> dict[str, Any]:
    return {
        "kv_lora_rank": geometry.kv_lora_rank,
        "rope_head_dim": geometry.rope_head_dim,
        "index_head_dim": geometry.index_head_dim,
        "max_tokens": geometry.max_tokens,
    }


def format_fields(fmt: LatentFormat | None) -> dict[str, Any]:
    if fmt is None:
        return {}
    if isinstance(fmt, AffineFormat):
        return {"bits": fmt.bits, "group_size": fmt.group_size}
    return {"k_bits": fmt.k_bits, "v_bits": fmt.v_bits}


def geometry_of(entry: CacheEntry, index: int | None) -> LatentGeometry:
    """The entry's geometry; missing or impossible values are an ``IncompatibleFormat`` naming the field."""
    for field in ("kv_lora_rank", "rope_head_dim"):
        if getattr(entry, field) is None:
            raise validate.incompatible(entry, index, field, "missing (a latent kind needs its geometry)")
    try:
        return LatentGeometry(entry.kv_lora_rank, entry.rope_head_dim, entry.index_head_dim, entry.max_tokens)
    except KvShelfError as exc:
        raise validate.incompatible(entry, index, "geometry", str(exc)) from None


def format_of(entry: CacheEntry, index: int | None) -> LatentFormat | None:
    """The entry's format: affine (bits, group_size), turbo (k_bits, v_bits) or None (f32); never a mix."""
    affine = (entry.bits, entry.group_size)
    turbo = (entry.k_bits, entry.v_bits)
    try:
        if any(v is not None for v in affine) and any(v is not None for v in turbo):
            raise validate.incompatible(entry, index, "bits/k_bits", "both an affine and a TurboQuant format are named")
        if any(v is not None for v in affine):
            if None in affine:
                raise validate.incompatible(entry, index, "bits/group_size", f"incomplete affine format {affine}")
            return AffineFormat(*affine)
        if any(v is not None for v in turbo):
            if None in turbo:
                raise validate.incompatible(entry, index, "k_bits/v_bits", f"incomplete TurboQuant format {turbo}")
            return TurboFormat(*turbo)
        return None
    except InvalidCacheState as exc:
        raise validate.incompatible(entry, index, "format", str(exc)) from None


@lru_cache(maxsize=256)
def plane_layout(fmt: LatentFormat | None, width: int) -> tuple[tuple[str, int], ...]:
    """(dtype name, width) of each stored plane of one family: one f32 plane, or the format's encoded planes."""
    if fmt is None:
        return (("float32", width),)
    encoding = family_encoding(fmt, width)
    return tuple((dtypes.dtype_name(d), w) for d, w in zip(encoding.plane_dtypes(), encoding.plane_widths()))


def family_layouts(entry: CacheEntry, index: int | None, geometry: LatentGeometry, fmt: LatentFormat | None):
    """Per family, its plane layout; a width the format cannot encode is an ``IncompatibleFormat``."""
    try:
        return [plane_layout(fmt, width) for width in geometry.widths]
    except InvalidCacheState as exc:
        raise validate.incompatible(entry, index, "format", str(exc)) from None


def require_serial(cache: Any, codec: Any = None) -> None:
    """Persistence takes one row; a batch must be split first (each row is its own snapshot). With ``codec``: the
    cache must also be one that codec persists (a codec called directly with another object refuses it)."""
    if codec is not None and not codec.matches(cache):
        raise IncompatibleFormat(f"codec {codec.kind!r} does not persist a {type(cache).__name__}")
    rows = cache.batch_size
    if rows is not None and rows != 1:
        raise InvalidCacheState(
            f"persistence takes serial state: this {cache.signature()} cache holds {rows} rows; "
            f"call extract_row(i) for each of the {rows} rows and snapshot each row on its own"
        )


def snapshot_floor(floor: int, offset: int) -> int:
    """The floor a snapshot records: the cache's, capped at its offset.

    A row converted at a nonzero start and then trimmed or rolled back below that point keeps its floor above its
    offset; such a state is still a valid continuation at its full length, which is what the cap records.
    """
    return min(floor, offset)


def make_slots(named: Sequence[tuple[str, mx.array, int | None]], checksums: bool = True) -> list[TensorSlot]:
    """Slots for arrays in order (evaluating them), with checksums unless ``checksums`` is False."""
    mx.eval([array for _, array, _ in named])
    return [
        TensorSlot(
            name=name,
            dtype=dtypes.dtype_name(array.dtype),
            shape=list(array.shape),
            token_axis=axis,
            nbytes=array.nbytes,
            checksum=checksum(array) if checksums else "",
        )
        for name, array, axis in named
    ]


def prefix_tensors(entry: CacheEntry, p: int) -> list[TensorSlot]:
    """Slots cut to ``p`` positions along their token axis (nbytes recomputed, checksums cleared)."""
    out = []
    for slot in entry.tensors:
        shape = list(slot.shape)
        if slot.token_axis is not None:
            shape[slot.token_axis] = p
        out.append(
            TensorSlot(
                name=slot.name,
                dtype=slot.dtype,
                shape=shape,
                token_axis=slot.token_axis,
                nbytes=dtypes.nbytes_of(slot.dtype, shape) if dtypes.is_known(slot.dtype) else 0,
                checksum="",
            )
        )
    return out


def check_prefix(entry: CacheEntry, p: int) -> None:
    """A prefix must lie within the entry and at or above its floor (below it the state is not reusable)."""
    from ...errors import CacheRangeError

    validate.require_entry(entry)

    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= entry.offset:
        raise CacheRangeError(f"prefix {p!r} is outside [0, {entry.offset}] of this {entry.kind} entry")
    if p < entry.minimum_reusable_offset:
        raise CacheRangeError(
            f"prefix {p} is below the entry's minimum_reusable_offset {entry.minimum_reusable_offset}"
        )


def blocks_for(p: int, block_size: int) -> int:
    return math.ceil(p / block_size)


def replace_entry(entry: CacheEntry, **changes: Any) -> CacheEntry:
    return msgspec.structs.replace(entry, **changes)


def check_rows(entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], what: str,
               fields: Sequence[str]) -> None:
    """Rows batched together: at least one, one array list each, and the same kind and ``fields``."""
    validate.require_rows(entries, arrays_per_row)
    if not entries:
        raise InvalidCacheState(f"{what}: load_batch needs at least one row")
    if len(entries) != len(arrays_per_row):
        raise InvalidCacheState(f"{what}: {len(entries)} entries but {len(arrays_per_row)} array lists")
    first = entries[0]
    for i, entry in enumerate(entries[1:], start=1):
        for key in ("kind", *fields):
            if getattr(entry, key) != getattr(first, key):
                raise InvalidCacheState(
                    f"{what}: row {i} has {key}={getattr(entry, key)!r} but row 0 has {getattr(first, key)!r}; "
                    "only rows of one layout batch together"
                )


_LATENT_LAYOUT = ("kv_lora_rank", "rope_head_dim", "index_head_dim", "max_tokens", "bits", "group_size",
                  "k_bits", "v_bits", "quantized_kv_start")


def same_layout(entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], what: str) -> None:
    """Rows batched together must share kind, geometry and format (everything but positions and tensors)."""
    check_rows(entries, arrays_per_row, what, _LATENT_LAYOUT)
    first = entries[0]
    if first.pages is not None:
        for i, entry in enumerate(entries[1:], start=1):
            if entry.pages is None or entry.pages.block_size != first.pages.block_size:
                raise InvalidCacheState(f"{what}: row {i} has another block size than row 0")


class RowStateCodec:
    """``load``/``load_batch`` and the plain prefix rule for codecs whose caches take rows as row states.

    An entry's checked arrays become one row state (``_state_of``), an empty cache takes the rows through
    ``merge_row_states``. A subclass gives ``validate``, ``_state_of``, ``_empty`` (the cache one entry's row goes
    into) and ``_check_batch`` (what rows batched together share); ``_batch_cache`` may check more across rows.
    """

    kind: str

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        raise NotImplementedError

    def _state_of(self, entry: CacheEntry, arrays: Sequence[mx.array], index: int | None) -> Any:
        raise NotImplementedError

    def _empty(self, entry: CacheEntry, index: int | None) -> Any:
        raise NotImplementedError

    def _check_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]]) -> None:
        raise NotImplementedError

    def _batch_cache(self, entries: Sequence[CacheEntry]) -> Any:
        """The empty cache a batch's rows go into (after every row state was made)."""
        return self._empty(entries[0], 0)

    def _row_state(self, entry: CacheEntry, arrays: Sequence[mx.array], verify: bool, index: int | None) -> Any:
        validate.require_entry(entry)
        self.validate(entry, index)
        validate.check_arrays(entry, index, arrays, verify)
        return self._state_of(entry, arrays, index)

    def load(
        self, entry: CacheEntry, arrays: Sequence[mx.array], *, verify: bool = True, index: int | None = None
    ) -> Any:
        state = self._row_state(entry, arrays, verify, index)
        cache = self._empty(entry, index)
        cache.merge_row_states([state])
        return cache

    def load_batch(
        self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], *, verify: bool = True
    ) -> Any:
        self._check_batch(entries, arrays_per_row)
        states = [self._row_state(e, a, verify, i) for i, (e, a) in enumerate(zip(entries, arrays_per_row))]
        cache = self._batch_cache(entries)
        cache.merge_row_states(states)
        return cache

    def batch_plan(self, entries: Sequence[CacheEntry]) -> BatchPlan | None:
        """Where each row's tensors land in the batched cache (entries checked as ``load_batch`` checks them), or
        None when this kind has no direct path (the reader then uses ``load_batch``)."""
        validate.require_entries(entries)
        entries = list(entries)
        self._check_batch(entries, [()] * len(entries))
        for i, entry in enumerate(entries):
            self.validate(entry, i)
        return self._plan(entries)

    def _plan(self, entries: list[CacheEntry]) -> BatchPlan | None:
        return None

    def adopt_batch(self, entries: Sequence[CacheEntry], arrays: Sequence[mx.array]) -> Any:
        """The batched cache around ``arrays`` (one per tensor of ``batch_plan(entries)``, filled), without copying."""
        validate.require_entries(entries)
        if isinstance(arrays, (str, bytes)) or not isinstance(arrays, Sequence) or not entries:
            raise InvalidCacheState("adopt_batch takes the entries of a batch_plan and one array per planned tensor")
        cache = self._batch_cache(list(entries))
        self._adopt(cache, list(entries), list(arrays))
        return cache

    def adopt_row(self, entry: CacheEntry, arrays: Sequence[mx.array]) -> Any:
        """The serial cache around one row's ``batch_plan([entry])`` arrays, without copying: for these kinds a
        one-row batch is the serial cache. (Codecs whose batched class differs from their serial one, such as
        mlx-lm's, offer no ``adopt_row``; the store then loads serial rows through ``load``.)"""
        return self.adopt_batch([entry], arrays)

    def _adopt(self, cache: Any, entries: list[CacheEntry], arrays: list[mx.array]) -> None:
        raise NotImplementedError(f"{self.kind}: no batch plan, so nothing to adopt")

    def header_trimmable(self, entry: CacheEntry) -> bool:
        validate.require_entry(entry)
        return True

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_prefix(entry, p)
        return replace_entry(entry, offset=p, tensors=prefix_tensors(entry, p))
