"""``MLACache`` <-> entries of kind ``mla`` (latent, rope) or ``mla-dsa`` (latent, rope, index keys).

The checkpoint-native f32 state: one ``[1, T, w]`` tensor per family, positions on axis 1, so any prefix of the
tokens is a prefix of every tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ...latent_legos.latent.mla import MLACache, MLARowState
from .. import validate
from ..batch_plan import BatchPlan, right_justified
from ..header import CacheEntry
from .latent_common import (
    RowStateCodec,
    family_names,
    geometry_fields,
    geometry_of,
    make_slots,
    require_serial,
    same_layout,
    snapshot_floor,
)
from ..validate import SlotSpec


class MLACodec(RowStateCodec):
    """One codec per kind: ``dsa`` selects caches (and entries) with DSA index keys."""

    def __init__(self, dsa: bool) -> None:
        self.dsa = dsa
        self.kind = "mla-dsa" if dsa else "mla"

    def __repr__(self) -> str:
        return f"MLACodec({self.kind!r})"

    def matches(self, cache: object) -> bool:
        return isinstance(cache, MLACache) and cache.geometry.has_index == self.dsa

    def snapshot(self, cache: MLACache, *, checksums: bool = True) -> tuple[CacheEntry, list[mx.array]]:
        require_serial(cache, self)
        geometry = cache.geometry
        if cache.batch_size is None:  # never appended to: zero positions of every family
            arrays = [mx.zeros((1, 0, w), dtype=mx.float32) for w in geometry.widths]
            offset, floor = 0, 0
        else:
            state = cache.row_state(0)
            arrays, offset = list(state.arrays), state.offset
            floor = snapshot_floor(state.minimum_reusable_offset, offset)
        slots = make_slots([(name, array, 1) for name, array in zip(family_names(geometry), arrays)], checksums)
        entry = CacheEntry(
            kind=self.kind, offset=offset, minimum_reusable_offset=floor, tensors=slots, **geometry_fields(geometry)
        )
        self.validate(entry)
        return entry, arrays

    def specs(self, entry: CacheEntry, index: int | None = None) -> list[SlotSpec]:
        geometry = geometry_of(entry, index)
        if geometry.has_index != self.dsa:
            raise validate.incompatible(
                entry, index, "index_head_dim",
                f"kind {self.kind!r} {'needs' if self.dsa else 'cannot have'} an index_head_dim (got {entry.index_head_dim})",
            )
        return [
            SlotSpec(name, "float32", (1, entry.offset, width), 1)
            for name, width in zip(family_names(geometry), geometry.widths)
        ]

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        validate.require_entry(entry)
        if entry.kind != self.kind:
            raise validate.incompatible(entry, index, "kind", f"expected {self.kind!r}")
        for field in ("bits", "group_size", "k_bits", "v_bits", "pages"):
            if getattr(entry, field) is not None:
                raise validate.incompatible(entry, index, field, f"an f32 {self.kind} entry has no {field}")
        if entry.shadow or entry.quantized_kv_start:
            raise validate.incompatible(entry, index, "shadow/quantized_kv_start", "an f32 entry has neither")
        specs = self.specs(entry, index)
        validate.check_positions(entry, index, entry.max_tokens)
        validate.check_slots(entry, index, specs)

    def _state_of(self, entry: CacheEntry, arrays: Sequence[mx.array], index: int | None) -> MLARowState:
        return MLARowState(arrays=list(arrays), offset=entry.offset, minimum_reusable_offset=entry.minimum_reusable_offset)

    def _empty(self, entry: CacheEntry, index: int | None) -> MLACache:
        return MLACache(geometry_of(entry, index))

    def _check_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]]) -> None:
        same_layout(entries, arrays_per_row, self.kind)

    def _plan(self, entries: list[CacheEntry]) -> BatchPlan:
        geometry = geometry_of(entries[0], 0)
        offsets = [e.offset for e in entries]
        width, rows = max(offsets), len(entries)
        return BatchPlan(tuple(
            right_justified(name, "float32", (rows, width, w), 1, width, [f] * rows, offsets)
            for f, (name, w) in enumerate(zip(family_names(geometry), geometry.widths))
        ))

    def _adopt(self, cache: MLACache, entries: list[CacheEntry], arrays: list[mx.array]) -> None:
        cache.adopt_batch(arrays, [e.offset for e in entries], max(e.minimum_reusable_offset for e in entries))
