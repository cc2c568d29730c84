"""``MLACache`` <-> entries of kind ``mla`` (latent, rope) or ``mla-dsa`` (latent, rope, index keys).

The checkpoint-native f32 state: one ``[1, T, w]`` tensor per family, positions on axis 1, so any prefix of the
tokens is a prefix of every tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..latent_legos.mla import MLACache, MLARowState
from . import validate
from .header import CacheEntry
from .latent_common import (
    check_prefix,
    family_names,
    geometry_fields,
    geometry_of,
    make_slots,
    prefix_tensors,
    replace_entry,
    require_serial,
    same_layout,
    snapshot_floor,
)
from .validate import SlotSpec


class MLACodec:
    """One codec per kind: ``dsa`` selects caches (and entries) with DSA index keys."""

    def __init__(self, dsa: bool) -> None:
        self.dsa = dsa
        self.kind = "mla-dsa" if dsa else "mla"

    def __repr__(self) -> str:
        return f"MLACodec({self.kind!r})"

    def matches(self, cache: object) -> bool:
        return isinstance(cache, MLACache) and cache.geometry.has_index == self.dsa

    def snapshot(self, cache: MLACache) -> tuple[CacheEntry, list[mx.array]]:
        require_serial(cache)
        geometry = cache.geometry
        if cache.batch_size is None:  # never appended to: zero positions of every family
            arrays = [mx.zeros((1, 0, w), dtype=mx.float32) for w in geometry.widths]
            offset, floor = 0, 0
        else:
            state = cache.row_state(0)
            arrays, offset = list(state.arrays), state.offset
            floor = snapshot_floor(state.minimum_reusable_offset, offset)
        slots = make_slots([(name, array, 1) for name, array in zip(family_names(geometry), arrays)])
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

    def _row_state(self, entry: CacheEntry, arrays: Sequence[mx.array], verify: bool, index: int | None) -> MLARowState:
        self.validate(entry, index)
        validate.check_arrays(entry, index, arrays, verify)
        return MLARowState(arrays=list(arrays), offset=entry.offset, minimum_reusable_offset=entry.minimum_reusable_offset)

    def load(self, entry: CacheEntry, arrays: Sequence[mx.array], *, verify: bool = True, index: int | None = None) -> MLACache:
        state = self._row_state(entry, arrays, verify, index)
        cache = MLACache(geometry_of(entry, index))
        cache.merge_row_states([state])
        return cache

    def load_batch(
        self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], *, verify: bool = True
    ) -> MLACache:
        same_layout(entries, arrays_per_row, self.kind)
        states = [self._row_state(e, a, verify, i) for i, (e, a) in enumerate(zip(entries, arrays_per_row))]
        cache = MLACache(geometry_of(entries[0], 0))
        cache.merge_row_states(states)
        return cache

    def header_trimmable(self, entry: CacheEntry) -> bool:
        return True

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_prefix(entry, p)
        return replace_entry(entry, offset=p, tensors=prefix_tensors(entry, p))
