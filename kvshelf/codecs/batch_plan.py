"""How a batch of serial entries lands in one batched cache: the tensors to allocate and where each row goes.

A codec that can say where every row's stored tensor belongs in the batched layout (``Codec.batch_plan``) lets a
reader write each row's bytes straight into one destination per batched tensor, then wrap those destinations in
the batched cache (``Codec.adopt_batch``) — no per-row arrays, no padding and concatenation. The plan is pure
geometry: the store allocates and fills it without knowing any cache's internals.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowSource:
    """Which slot of a row's entry fills this row of a batched tensor (None: the row stays zero), and where its
    position 0 lands along the token axis."""

    slot: int | None
    start: int


@dataclass(frozen=True)
class BatchTensor:
    """One batched tensor: axis 0 is the row; row b's slot fills ``[start, start + T_b)`` of ``token_axis``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    token_axis: int
    rows: tuple[RowSource, ...]


@dataclass(frozen=True)
class BatchPlan:
    """Every batched tensor of one layer, in the order ``adopt_batch`` takes them."""

    tensors: tuple[BatchTensor, ...]

    def targets(self) -> dict[tuple[int, int], tuple[int, int]]:
        """``(row, slot) -> (tensor index, start)`` for every slot a row contributes."""
        out = {}
        for k, tensor in enumerate(self.tensors):
            for row, source in enumerate(tensor.rows):
                if source.slot is not None:
                    out[(row, source.slot)] = (k, source.start)
        return out


def right_justified(name: str, dtype: str, shape: tuple[int, ...], token_axis: int, width: int,
                    slots: list[int | None], offsets: list[int]) -> BatchTensor:
    """A tensor whose rows end at column ``width`` (left zero padding), as every right-justified merge lays them."""
    return BatchTensor(name, dtype, tuple(shape), token_axis,
                       tuple(RowSource(s, width - o) for s, o in zip(slots, offsets)))


__all__ = ["BatchPlan", "BatchTensor", "RowSource", "right_justified"]
