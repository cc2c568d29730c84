"""``PagedLatentCache`` <-> entries of kind ``latent-paged``.

Tensors: the row's whole pools as they are (unused blocks included), one per stored plane (``latent.pool`` for f32
pages, ``latent.0.pool``, ``latent.1.pool``, ... for encoded ones), ``[num_blocks, block_size, w]`` with no token
axis; the header carries the block table. A restore rebuilds the same free list, so later appends land in the same
physical blocks as they would have in the original.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ...errors import InvalidCacheState
from ...latent_legos.latent.pages import LatentPages
from ...latent_legos.latent.paged import PagedLatentCache
from .. import validate
from ..dtypes import mlx_dtype
from ..header import CacheEntry, PageLayout
from .latent_common import (
    blocks_for,
    check_prefix,
    family_layouts,
    family_names,
    format_fields,
    format_of,
    geometry_fields,
    geometry_of,
    make_slots,
    plane_layout,
    prefix_tensors,
    replace_entry,
    require_serial,
    same_layout,
    snapshot_floor,
)
from ..validate import SlotSpec

KIND = "latent-paged"


class PagedCodec:
    kind = KIND

    def __repr__(self) -> str:
        return "PagedCodec()"

    def matches(self, cache: object) -> bool:
        return isinstance(cache, PagedLatentCache)

    def _names(self, geometry, fmt) -> list[str]:
        names = family_names(geometry)
        layouts = [plane_layout(fmt, w) for w in geometry.widths]
        if fmt is None:
            return [f"{name}.pool" for name in names]
        return [f"{name}.{i}.pool" for name, layout in zip(names, layouts) for i in range(len(layout))]

    def snapshot(self, cache: PagedLatentCache, *, checksums: bool = True) -> tuple[CacheEntry, list[mx.array]]:
        require_serial(cache, self)
        geometry, fmt, block_size = cache.geometry, cache.format, cache.block_size
        flat_layout = [spec for w in geometry.widths for spec in plane_layout(fmt, w)]
        pages = cache.pages[0] if cache.batch_size is not None else None
        if pages is not None and cache.row_offsets[0] != pages.offset:
            raise InvalidCacheState(
                f"cannot snapshot a {cache.signature()} cache during a prefill "
                f"(its pages hold {pages.offset} positions, {cache.row_offsets[0]} of them real); finalize_prefill first"
            )
        if pages is None or not pages.pools:  # nothing allocated yet: zero-block pools
            pools = [mx.zeros((0, block_size, w), dtype=mlx_dtype(d)) for d, w in flat_layout]
            table, num_blocks, offset = [], 0, 0
        else:
            pools, table, num_blocks, offset = (cache.persisted_pools(pages.pools), list(pages.block_table),
                                                pages.num_blocks, pages.offset)
        named = [(name, pool, None) for name, pool in zip(self._names(geometry, fmt), pools)]
        entry = CacheEntry(
            kind=KIND,
            offset=offset,
            minimum_reusable_offset=snapshot_floor(cache.minimum_reusable_offset, offset),
            pages=PageLayout(block_size=block_size, block_table=table, num_blocks=num_blocks),
            tensors=make_slots(named, checksums),
            **geometry_fields(geometry),
            **format_fields(fmt),
        )
        self.validate(entry)
        return entry, pools

    def specs(self, entry: CacheEntry, index: int | None = None) -> list[SlotSpec]:
        geometry = geometry_of(entry, index)
        fmt = format_of(entry, index)
        layouts = family_layouts(entry, index, geometry, fmt)
        pages = entry.pages
        flat = [spec for layout in layouts for spec in layout]
        return [
            SlotSpec(name, dtype, (pages.num_blocks, pages.block_size, width), None)
            for name, (dtype, width) in zip(self._names(geometry, fmt), flat)
        ]

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        validate.require_entry(entry)
        if entry.kind != KIND:
            raise validate.incompatible(entry, index, "kind", f"expected {KIND!r}")
        if entry.shadow or entry.quantized_kv_start:
            raise validate.incompatible(entry, index, "shadow/quantized_kv_start", "a paged entry has neither")
        validate.check_pages(entry, index)
        specs = self.specs(entry, index)
        validate.check_positions(entry, index, entry.max_tokens)
        validate.check_slots(entry, index, specs)

    def _pages(self, entry: CacheEntry, arrays: Sequence[mx.array], verify: bool, index: int | None) -> LatentPages:
        validate.require_entry(entry)
        self.validate(entry, index)
        validate.check_arrays(entry, index, arrays, verify)
        layout = entry.pages
        pools = self._empty(entry, index).held_pools(arrays)  # TurboQuant k8 codes are held pre-flipped
        return LatentPages.restored(layout.block_size, pools, list(layout.block_table), layout.num_blocks, entry.offset)

    def _empty(self, entry: CacheEntry, index: int | None) -> PagedLatentCache:
        return PagedLatentCache(geometry_of(entry, index), format_of(entry, index), entry.pages.block_size)

    def load(
        self, entry: CacheEntry, arrays: Sequence[mx.array], *, verify: bool = True, index: int | None = None
    ) -> PagedLatentCache:
        pages = self._pages(entry, arrays, verify, index)
        cache = self._empty(entry, index)
        cache.adopt_rows([pages])
        cache.minimum_reusable_offset = entry.minimum_reusable_offset
        return cache

    def load_batch(
        self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], *, verify: bool = True
    ) -> PagedLatentCache:
        same_layout(entries, arrays_per_row, KIND)
        rows = [self._pages(e, a, verify, i) for i, (e, a) in enumerate(zip(entries, arrays_per_row))]
        cache = self._empty(entries[0], 0)
        cache.adopt_rows(rows)
        cache.minimum_reusable_offset = max(e.minimum_reusable_offset for e in entries)
        return cache

    def header_trimmable(self, entry: CacheEntry) -> bool:
        validate.require_entry(entry)
        return True

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_prefix(entry, p)
        layout = entry.pages
        if layout is None:
            raise validate.incompatible(entry, None, "pages", "missing")
        table = list(layout.block_table[: blocks_for(p, layout.block_size)])
        return replace_entry(
            entry,
            offset=p,
            pages=PageLayout(block_size=layout.block_size, block_table=table, num_blocks=layout.num_blocks),
            tensors=prefix_tensors(entry, p),
        )
