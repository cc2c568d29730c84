"""Dense block tables for paged snapshots: pools re-laid so the table reads ``0..n-1`` and unused blocks are gone.

A paged row keeps its whole pool, including blocks freed by trims or allocated ahead; its entry stores them all.
Gathering the pool along the block table gives the same position -> value mapping with only the blocks a page
uses, so every read is bit-identical; what changes is the free list (empty afterwards), i.e. where *later* appends
land physically — never what they read.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import msgspec

from ..codecs.checksum import checksum
from ..codecs.header import CacheEntry, PageLayout, TensorSlot
from ..errors import InvalidCacheState


def is_dense(entry: CacheEntry) -> bool:
    """True for unpaged entries and for paged ones whose table is already ``0..n-1`` over an ``n``-block pool."""
    pages = entry.pages
    if pages is None:
        return True
    return pages.num_blocks == len(pages.block_table) and list(pages.block_table) == list(range(pages.num_blocks))


def dropped_blocks(entry: CacheEntry) -> int:
    """How many pool blocks densifying would drop."""
    return 0 if entry.pages is None else entry.pages.num_blocks - len(entry.pages.block_table)


def densify(entry: CacheEntry, arrays: Sequence[mx.array]) -> tuple[CacheEntry, list[mx.array]]:
    """The entry and pools of the same paged row with a dense block table (a no-op for dense or unpaged entries)."""
    if is_dense(entry):
        return entry, list(arrays)
    pages = entry.pages
    if len(arrays) != len(entry.tensors):
        raise InvalidCacheState(f"densify: entry {entry.kind} lists {len(entry.tensors)} tensors, got {len(arrays)}")
    table = mx.array(list(pages.block_table), dtype=mx.int32)
    n = len(pages.block_table)
    pools, slots = [], []
    for slot, pool in zip(entry.tensors, arrays):
        if slot.token_axis is not None or pool.ndim < 1 or pool.shape[0] != pages.num_blocks:
            raise InvalidCacheState(
                f"densify: tensor {slot.name} of a {entry.kind} entry has shape {list(pool.shape)}, "
                f"expected a pool of {pages.num_blocks} blocks"
            )
        dense = mx.take(pool, table, axis=0) if n else pool[:0]
        dense = mx.contiguous(dense)
        mx.eval(dense)
        pools.append(dense)
        slots.append(TensorSlot(name=slot.name, dtype=slot.dtype, shape=list(dense.shape), token_axis=None,
                                nbytes=dense.nbytes, checksum=checksum(dense) if slot.checksum else ""))
    layout = PageLayout(block_size=pages.block_size, block_table=list(range(n)), num_blocks=n)
    return msgspec.structs.replace(entry, pages=layout, tensors=slots), pools


__all__ = ["densify", "is_dense", "dropped_blocks"]
