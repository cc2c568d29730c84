"""Spare column capacity behind right-justified row storage, so a decode append writes only its new columns.

``MLACache`` and ``EncodedLatentCache`` hold each stored array as a buffer ``[B, capacity, w]`` whose first
``width`` columns are the stored positions (rows right-justified inside them: row b holds ``[width - offset_b,
width)``, zeros before); columns ``[width, capacity)`` are spare, never read and never exposed (``views()``,
``state``, row states and snapshots cut at ``width``).

Why the capacity sits on the right: every row ends at the write head ``width``, so an append of L positions writes
columns ``[width, width + L)`` of every row at once — one slice assignment, which MLX performs in place when
nothing else holds the buffer (and copies, keeping every earlier view intact, when something does) — and
trimming or rolling back moves the head left without touching a byte. A left-aligned buffer with per-row start
offsets would turn each batched append into per-row scatters and each read into a gather back to the
right-justified layout the attention expects.

Growth: a write past the capacity reallocates to ``needed + max(MIN_STEP, needed // GROWTH_DIVISOR)`` columns, so
the copy of ``needed`` columns is paid for by at least ``needed / 16`` later appends — O(1) bytes amortised per
appended position whatever the stored length — and the spare capacity stays within 1/16 of the stored width
(plus ``MIN_STEP`` columns) for the memory target. ``copied_bytes`` counts what growth copied (tests read it).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

MIN_STEP = 64
GROWTH_DIVISOR = 16


def capacity_for(needed: int) -> int:
    """Columns to allocate when ``needed`` columns no longer fit."""
    return needed + max(MIN_STEP, needed // GROWTH_DIVISOR)


class ColumnBuffers:
    """A family of buffers ``[B, capacity, w_i]`` sharing one write head ``width`` (see the module docstring)."""

    def __init__(self) -> None:
        self.arrays: list[mx.array] = []
        self.width = 0
        self.copied_bytes = 0

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[1] if self.arrays else 0

    @property
    def nbytes(self) -> int:
        """Bytes held, spare capacity included."""
        return sum(a.nbytes for a in self.arrays)

    def __bool__(self) -> bool:
        return self.width > 0

    def views(self) -> list[mx.array]:
        """The stored columns of every buffer, ``[B, width, w_i]`` (views, nothing copied); ``[]`` while empty."""
        if not self.width:
            return []
        return [a[:, : self.width, :] for a in self.arrays]

    def adopt(self, arrays: Sequence[mx.array]) -> None:
        """Hold ``arrays`` (``[B, T, w_i]``, every column stored) with no spare capacity. Each is wrapped in a
        private view, so a later in-place write can never rebind an object the caller still holds."""
        arrays = list(arrays)
        self.arrays = [a[:] for a in arrays]
        self.width = arrays[0].shape[1] if arrays else 0
        if not self.width:
            self.arrays = []

    def truncate(self, width: int) -> None:
        """Move the head back to ``width`` columns; the columns beyond become spare (no byte moves)."""
        self.width = min(self.width, width)

    def write(self, pieces: Sequence[mx.array], at: int) -> None:
        """Store ``pieces`` (``[B, L, w_i]``) at columns ``[at, at + L)`` and move the head to ``at + L``.

        ``at`` is the current width, or (while nothing is held) the width of zero columns to put before them.
        """
        length = pieces[0].shape[1]
        end = at + length
        if self.arrays and end <= self.capacity:
            for array, piece in zip(self.arrays, pieces):
                array[:, at:end, :] = piece
        else:
            spare = capacity_for(end) - end
            grown = []
            for i, piece in enumerate(pieces):
                batch, _, w = piece.shape
                parts = []
                if at:
                    if self.arrays:
                        parts.append(self.arrays[i][:, :at, :])
                        self.copied_bytes += batch * at * w * piece.itemsize
                    else:
                        parts.append(mx.zeros((batch, at, w), dtype=piece.dtype))
                parts += [piece, mx.zeros((batch, spare, w), dtype=piece.dtype)]
                grown.append(mx.concatenate(parts, axis=1))
            self.arrays = grown
        self.width = end

    def clear(self) -> None:
        self.arrays, self.width = [], 0


__all__ = ["GROWTH_DIVISOR", "MIN_STEP", "ColumnBuffers", "capacity_for"]
