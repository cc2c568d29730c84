"""``EncodedLatentCache`` <-> entries of kind ``latent-encoded``.

Tensors: every family's encoded planes in family order (``latent.0``, ``latent.1``, ... ``rope.0``, ...), then,
while the row has not converted (``shadow``), one f32 shadow per family (``latent.shadow``, ...). All are
``[1, T, w]`` with positions on axis 1. ``quantized_kv_start`` and the floor travel in the header, so the restored
row converts (or stays converted) exactly as the original would.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ...latent_legos.latent.encoded import EncodedLatentCache, EncodedRowState
from .. import validate
from ..batch_plan import BatchPlan, right_justified
from ..dtypes import mlx_dtype
from ..header import CacheEntry
from .latent_common import (
    RowStateCodec,
    family_layouts,
    family_names,
    format_fields,
    format_of,
    geometry_fields,
    geometry_of,
    make_slots,
    plane_layout,
    require_serial,
    same_layout,
    snapshot_floor,
)
from ..validate import SlotSpec

KIND = "latent-encoded"


class EncodedCodec(RowStateCodec):
    kind = KIND

    def __repr__(self) -> str:
        return "EncodedCodec()"

    def matches(self, cache: object) -> bool:
        return isinstance(cache, EncodedLatentCache)

    def snapshot(self, cache: EncodedLatentCache, *, checksums: bool = True) -> tuple[CacheEntry, list[mx.array]]:
        require_serial(cache, self)
        geometry, fmt = cache.geometry, cache.format
        layouts = [plane_layout(fmt, w) for w in geometry.widths]
        empty_planes = [[mx.zeros((1, 0, w), dtype=mlx_dtype(d)) for d, w in layout] for layout in layouts]
        empty_shadow = [mx.zeros((1, 0, w), dtype=mx.float32) for w in geometry.widths]
        if cache.batch_size is None:  # never appended to: an unconverted row at offset 0
            planes, shadow, offset, floor = empty_planes, empty_shadow, 0, 0
        else:
            state = cache.row_state(0)
            offset, floor = state.offset, snapshot_floor(state.minimum_reusable_offset, state.offset)
            planes = [list(family) for family in state.planes] if state.planes else empty_planes
            shadow = None if state.shadow is None else (list(state.shadow) if state.shadow else empty_shadow)
        names = family_names(geometry)
        named = [(f"{name}.{i}", plane, 1) for name, family in zip(names, planes) for i, plane in enumerate(family)]
        if shadow is not None:
            named += [(f"{name}.shadow", values, 1) for name, values in zip(names, shadow)]
        entry = CacheEntry(
            kind=KIND,
            offset=offset,
            minimum_reusable_offset=floor,
            quantized_kv_start=cache.start,
            shadow=shadow is not None,
            tensors=make_slots(named, checksums),
            **geometry_fields(geometry),
            **format_fields(fmt),
        )
        self.validate(entry)
        return entry, [array for _, array, _ in named]

    def specs(self, entry: CacheEntry, index: int | None = None) -> list[SlotSpec]:
        geometry = geometry_of(entry, index)
        fmt = format_of(entry, index)
        if fmt is None:
            raise validate.incompatible(entry, index, "bits/k_bits", "an encoded entry needs a format")
        names = family_names(geometry)
        specs = [
            SlotSpec(f"{name}.{i}", dtype, (1, entry.offset, width), 1)
            for name, layout in zip(names, family_layouts(entry, index, geometry, fmt))
            for i, (dtype, width) in enumerate(layout)
        ]
        if entry.shadow:
            specs += [SlotSpec(f"{name}.shadow", "float32", (1, entry.offset, w), 1) for name, w in zip(names, geometry.widths)]
        return specs

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        validate.require_entry(entry)
        if entry.kind != KIND:
            raise validate.incompatible(entry, index, "kind", f"expected {KIND!r}")
        if entry.pages is not None:
            raise validate.incompatible(entry, index, "pages", "an encoded (unpaged) entry has no pages")
        specs = self.specs(entry, index)
        validate.check_positions(entry, index, entry.max_tokens)
        validate.check_slots(entry, index, specs)

    def _state_of(self, entry: CacheEntry, arrays: Sequence[mx.array], index: int | None) -> EncodedRowState:
        geometry = geometry_of(entry, index)
        layouts = family_layouts(entry, index, geometry, format_of(entry, index))
        planes, at = [], 0
        for layout in layouts:
            planes.append(list(arrays[at : at + len(layout)]))
            at += len(layout)
        shadow = list(arrays[at:]) if entry.shadow else None
        return EncodedRowState(
            planes=planes, shadow=shadow, offset=entry.offset, minimum_reusable_offset=entry.minimum_reusable_offset
        )

    def _empty(self, entry: CacheEntry, index: int | None) -> EncodedLatentCache:
        return EncodedLatentCache(geometry_of(entry, index), format_of(entry, index), entry.quantized_kv_start)

    def _check_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]]) -> None:
        same_layout(entries, arrays_per_row, KIND)

    def _plan(self, entries: list[CacheEntry]) -> BatchPlan:
        geometry = geometry_of(entries[0], 0)
        layouts = family_layouts(entries[0], 0, geometry, format_of(entries[0], 0))
        offsets = [e.offset for e in entries]
        width, rows = max(offsets), len(entries)
        tensors, slot = [], 0
        for name, layout in zip(family_names(geometry), layouts):
            for i, (dtype, w) in enumerate(layout):
                tensors.append(right_justified(f"{name}.{i}", dtype, (rows, width, w), 1, width, [slot] * rows, offsets))
                slot += 1
        if any(e.shadow for e in entries):  # converted rows have no shadow slot: their rows stay zero
            for f, (name, w) in enumerate(zip(family_names(geometry), geometry.widths)):
                slots = [slot + f if e.shadow else None for e in entries]
                tensors.append(right_justified(f"{name}.shadow", "float32", (rows, width, w), 1, width, slots, offsets))
        return BatchPlan(tuple(tensors))

    def _adopt(self, cache: EncodedLatentCache, entries: list[CacheEntry], arrays: list[mx.array]) -> None:
        count = sum(len(layout) for layout in family_layouts(entries[0], 0, cache.geometry, cache.format))
        shadow = arrays[count:] if any(e.shadow for e in entries) else None
        cache.adopt_batch(arrays[:count], shadow, [e.offset for e in entries], [not e.shadow for e in entries],
                          [e.minimum_reusable_offset for e in entries])
