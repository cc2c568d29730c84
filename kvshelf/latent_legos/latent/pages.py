"""``LatentPages``: one row's positions in fixed-size blocks, per stored plane a pool ``[num_blocks, block_size, w]``.

The block table maps logical block i (positions ``[i*block_size, (i+1)*block_size)``) to a physical block of the
pools. Free blocks are handed out lowest first; pools grow to ``max(n + 1, ceil(1.5 n))`` blocks when none is
free. Methods that change the pages check first and write last.

An append writes its positions into their blocks in place (slice assignment, which MLX performs without copying
the pool when nothing else holds it), so a decode step costs O(1) bytes plus the amortised 1.5x growth. Pages
built by appends and trims alone hand out blocks in table order (block i of the row is physical block i), so
``gather`` is then a reshape view of each pool cut to the stored positions, not a copy; any other table is
gathered with ``mx.take``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

from ...errors import InvalidCacheState
from ..rows import non_negative, owned


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidCacheState(f"{name} must be a positive integer (got {value!r})")
    return value


class LatentPages:
    """One row's pages (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = _positive(block_size, "block_size")
        self.pools: list[mx.array] = []
        self.block_table: list[int] = []
        self.num_blocks = 0
        self.offset = 0
        self._free: set[int] = set()

    @property
    def free_list(self) -> list[int]:
        """Free physical blocks in the order they will be handed out."""
        return sorted(self._free)

    @classmethod
    def restored(
        cls,
        block_size: int,
        pools: Sequence[mx.array],
        block_table: Sequence[int],
        num_blocks: int,
        offset: int,
    ) -> LatentPages:
        """Pages from saved pools (adopted) holding ``offset`` positions in ``block_table``'s blocks."""
        pages = cls(block_size)
        non_negative(num_blocks, "num_blocks")
        non_negative(offset, "pages offset")
        table = [non_negative(b, "block table entry") for b in block_table]
        if len(table) != math.ceil(offset / block_size):
            raise InvalidCacheState(
                f"block table of {len(table)} blocks cannot hold {offset} positions in blocks of {block_size}"
            )
        if len(set(table)) != len(table) or any(b >= num_blocks for b in table):
            raise InvalidCacheState(f"block table {table} must name distinct blocks below num_blocks {num_blocks}")
        for pool in pools:
            if not isinstance(pool, mx.array) or pool.ndim != 3 or tuple(pool.shape[:2]) != (num_blocks, block_size):
                shape = tuple(pool.shape) if isinstance(pool, mx.array) else type(pool).__name__
                raise InvalidCacheState(f"pool shape {shape} != [{num_blocks}, {block_size}, w]")
        if offset and not pools:
            raise InvalidCacheState(f"pages holding {offset} positions need pools")
        pages.pools = [p[:] for p in pools]  # private objects: an in-place append never rebinds the caller's
        pages.block_table, pages.num_blocks, pages.offset = table, num_blocks, offset
        pages._free = set(range(num_blocks)) - set(table)
        return pages

    def clone(self) -> LatentPages:
        copy = LatentPages(self.block_size)
        copy.pools = [owned(p) for p in self.pools]
        copy.block_table, copy.num_blocks, copy.offset = list(self.block_table), self.num_blocks, self.offset
        copy._free = set(self._free)
        return copy

    def appended(self, planes: Sequence[mx.array]) -> LatentPages:
        """A new ``LatentPages`` holding these positions plus ``planes`` (each ``[1, L, w_i]``) at the end."""
        out = self.clone()
        out._append(planes)
        return out

    def append(self, planes: Sequence[mx.array]) -> None:
        """Store ``planes`` (each ``[1, L, w_i]``) after the stored positions, in place."""
        self._append(planes)

    def _append(self, planes: Sequence[mx.array]) -> None:
        length = planes[0].shape[1]
        if self.pools and len(planes) != len(self.pools):
            raise InvalidCacheState(f"appending {len(planes)} planes to pages of {len(self.pools)} pools")
        if not self.pools:
            self.pools = [mx.zeros((1, self.block_size, p.shape[2]), dtype=p.dtype) for p in planes]
            self.num_blocks, self._free = 1, {0}
        written = 0
        while written < length:
            position = self.offset + written
            block, within = divmod(position, self.block_size)
            while len(self.block_table) <= block:
                if not self._free:
                    self._grow(max(self.num_blocks + 1, math.ceil(self.num_blocks * 1.5)))
                physical = min(self._free)
                self._free.discard(physical)
                self.block_table.append(physical)
            count = min(self.block_size - within, length - written)
            physical = self.block_table[block]
            whole = count == length  # the common decode step: write the planes as they are, no slice of them
            for pool, plane in zip(self.pools, planes):
                if whole:
                    pool[physical : physical + 1, within : within + count, :] = plane
                else:
                    pool[physical, within : within + count, :] = plane[0, written : written + count, :]
            written += count
        self.offset += length

    def _grow(self, blocks: int) -> None:
        extra = blocks - self.num_blocks
        self.pools = [
            mx.concatenate([p, mx.zeros((extra, *p.shape[1:]), dtype=p.dtype)], axis=0) for p in self.pools
        ]
        self._free.update(range(self.num_blocks, blocks))
        self.num_blocks = blocks

    def in_table_order(self) -> bool:
        """Whether logical block i is physical block i for every stored block (``gather`` is then a view)."""
        table = self.block_table
        return not table or (table[-1] == len(table) - 1 and table == list(range(len(table))))

    def gather(self) -> list[mx.array]:
        """The stored planes in order, ``[1, offset, w_i]`` each."""
        if not self.offset:
            return [mx.zeros((1, 0, p.shape[2]), dtype=p.dtype) for p in self.pools]
        if self.in_table_order():
            span = self.num_blocks * self.block_size
            return [p.reshape(1, span, p.shape[2])[:, : self.offset, :] for p in self.pools]
        table = mx.array(self.block_table, dtype=mx.int32)
        out = []
        for pool in self.pools:
            picked = mx.take(pool, table, axis=0).reshape(1, len(self.block_table) * self.block_size, pool.shape[2])
            out.append(picked[:, : self.offset, :])
        return out

    def trim(self, n: int) -> None:
        """Drop the last ``n`` positions; emptied tail blocks return to the free list."""
        self.offset = max(0, self.offset - non_negative(n, "trim count"))
        need = math.ceil(self.offset / self.block_size)
        while len(self.block_table) > need:
            self._free.add(self.block_table.pop())

    def keep(self, start: int, stop: int) -> None:
        """Keep positions ``[start, stop)`` only (the stored planes rewritten, never re-encoded)."""
        if not 0 <= start <= stop <= self.offset:
            raise InvalidCacheState(f"cannot keep [{start}, {stop}) of {self.offset} positions")
        if start == 0 and stop == self.offset:
            return
        kept = [p[:, start:stop, :] for p in self.gather()]
        staged = self.clone()
        staged.trim(staged.offset)
        if stop > start:
            staged._append(kept)
        self.__dict__.update(staged.__dict__)

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def dispose(self) -> None:
        self.pools, self.block_table, self._free = [], [], set()
        self.num_blocks = self.offset = 0
