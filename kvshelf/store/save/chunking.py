"""Cutting a snapshot's tensors into chunks (the save side; reading them back is ``restore/destinations.py``).

Writing: every tensor with a ``token_axis`` is cut at multiples of ``chunk_tokens``; the pieces of all caches for one
token range form one chunk (tensor names ``"<cache>.<slot>.<slot name>"``). Tensors without a token axis form one more
chunk. Pieces are zero-copy numpy views of the evaluated MLX arrays (bf16 through a uint16 view), cut into their
contiguous runs only when a chunk is hashed or written (a grown session's save reuses most hashes and writes few
chunks, and the run views of a 512 MiB cache cost more than its reused hashes).

Where the cuts fall (``cuts``): a save first keeps the cuts of the stored snapshot it extends (``alignment.py`` says
which), then cuts at the next multiples of ``chunk_tokens``. Why: with cuts only at multiples of ``chunk_tokens``, the
window straddling a session's old end was a new chunk at every save, so a chat re-saved every 100 tokens wrote each
token's bytes about 2.3 times (every turn rewrote the partial window). Kept cuts make a grown session write its new
rows only — the old tail chunk stays a chunk of its own — and cutting at the stored cuts, not at a save's own
history, keeps dedupe: whatever extends a stored snapshot (the session itself, a fork restored from it, its prefix
checkpoints) cuts the shared rows where it was cut, so they name the same chunks. Two rules bound how small chunks
get (``min_chunk``, a quarter of ``chunk_tokens``): a stored tail chunk (one ending at a save's end) shorter than
that is not kept but rewritten once with what follows, a cut that would leave less than that before
the next multiple moves to the multiple after it, and a chunk starting off the grid takes in a short rest rather than
leave it as a tail. So turns of at least a quarter chunk write their rows once (a chat of 100-token turns at
``chunk_tokens=256``: 1.00×), shorter turns at most ``min_chunk`` rows more per save, and a session saved in one go is
cut exactly as before (multiples of ``chunk_tokens``), so prefixes shared by one-shot saves dedupe as they did.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...codecs.header import CacheEntry
from ..objects.chunkfile import Piece, axis_window, descriptor
from ..objects.runhash import RunHash

def host_view(array: mx.array) -> np.ndarray:
    """A zero-copy numpy view of an evaluated MLX array (bf16 as uint16)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
        mx.eval(array)
    return np.array(array, copy=False)


def runs(region: np.ndarray) -> list[memoryview]:
    """The region's bytes in C order as the contiguous runs it is made of (zero-copy): one view when it is
    contiguous, else one per index of its leading axes down to the deepest contiguous block."""
    if region.size == 0:
        return [memoryview(b"")]
    if region.flags["C_CONTIGUOUS"]:
        return [memoryview(region).cast("B")]
    inner, k = region.itemsize, region.ndim
    while k > 0 and (region.shape[k - 1] == 1 or region.strides[k - 1] == inner):
        inner *= region.shape[k - 1]
        k -= 1
    if k == 0:  # pragma: no cover - C-contiguous after all
        return [memoryview(np.ascontiguousarray(region)).cast("B")]
    return [memoryview(region[idx]).cast("B") for idx in np.ndindex(*region.shape[:k])]


def _as_piece(name: str, dtype: str, region: np.ndarray) -> Piece:
    segs = runs(region)
    return Piece(name, dtype, tuple(region.shape), segs[0] if len(segs) == 1 else segs)


@dataclass(frozen=True)
class Region:
    """One tensor of a chunk before it is cut into runs: its name, mlx dtype name and numpy view."""

    name: str
    dtype: str
    host: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.host.shape)


class ChunkPlan:
    """One chunk to write: the token range it covers ([0, 0) for the untokened chunk) and its tensors' regions; the
    pieces (zero-copy runs) are made on first use."""

    def __init__(self, start: int, stop: int, regions: list[Region]):
        self.start, self.stop, self.regions = start, stop, regions
        self._pieces: list[Piece] | None = None

    @property
    def pieces(self) -> list[Piece]:
        if self._pieces is None:
            self._pieces = [_as_piece(r.name, r.dtype, r.host) for r in self.regions]
        return self._pieces

    @property
    def nbytes(self) -> int:
        return sum(r.host.nbytes for r in self.regions)

    def content_hash(self, desc: bytes) -> str:
        """``chunkfile.content_hash`` of the pieces (same digest), fed from the regions' run addresses on the
        calling thread with the GIL released: what a save's hash pool runs."""
        h = RunHash(desc)
        for r in self.regions:
            h.update_strided(r.host)
        return h.hexdigest()

    def descriptor(self) -> bytes:
        """What the content hash starts with (``chunkfile.descriptor`` of the pieces), without making them."""
        return descriptor(self.regions)


def min_chunk(chunk_tokens: int) -> int:
    """The shortest chunk ``cuts`` makes on purpose (a session's tail may be shorter until it grows)."""
    return max(1, chunk_tokens // 4)


def cuts(extent: int, chunk_tokens: int, stored: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The token windows ``[start, stop)`` of a save of ``extent`` positions: the ``stored`` windows (sorted, from 0)
    that still lie below ``extent`` and follow on from each other, less a short tail; then windows ending at
    multiples of ``chunk_tokens`` (never shorter than ``min_chunk`` unless it is the last one), the last at
    ``extent`` (see the module docstring)."""
    small = min_chunk(chunk_tokens)
    out: list[tuple[int, int]] = []
    at = 0
    for start, stop in stored:
        if start != at or stop > extent or stop <= start:
            break
        out.append((start, stop))
        at = stop
    while out and out[-1][1] - out[-1][0] < small:
        out.pop()  # a short tail kept would stay short for good: rewrite it once with what follows
    at = out[-1][1] if out else 0
    while at < extent:
        stop = (at // chunk_tokens + 1) * chunk_tokens
        if stop - at < small:
            stop += chunk_tokens
        if at % chunk_tokens and extent - stop < small:
            stop = extent  # off the grid already: no short tail that the next save would rewrite
        stop = min(stop, extent)
        out.append((at, stop))
        at = stop
    return out


def plan_chunks(entries: list[CacheEntry], arrays: list[list[mx.array]], chunk_tokens: int,
                stored: list[tuple[int, int]] = ()) -> list[ChunkPlan]:
    """Token chunks in token order (cut by ``cuts``, keeping ``stored``'s windows), then (if any) the chunk of
    tensors without a token axis."""
    hosts = [[host_view(a) for a in row] for row in arrays]
    extent = 0
    for entry, row in zip(entries, hosts):
        for slot, host in zip(entry.tensors, row):
            if slot.token_axis is not None:
                extent = max(extent, host.shape[slot.token_axis])
    plans = []
    for start, stop in cuts(extent, chunk_tokens, stored):
        pieces = []
        for i, (entry, row) in enumerate(zip(entries, hosts)):
            for j, (slot, host) in enumerate(zip(entry.tensors, row)):
                if slot.token_axis is None or host.shape[slot.token_axis] <= start:
                    continue
                region = axis_window(host, slot.token_axis, start, min(stop, host.shape[slot.token_axis]))
                pieces.append(Region(f"{i}.{j}.{slot.name}", slot.dtype, region))
        plans.append(ChunkPlan(start, stop, pieces))
    own = [
        Region(f"{i}.{j}.{slot.name}", slot.dtype, host)
        for i, (entry, row) in enumerate(zip(entries, hosts))
        for j, (slot, host) in enumerate(zip(entry.tensors, row))
        if slot.token_axis is None
    ]
    if own:
        plans.append(ChunkPlan(0, 0, own))
    return plans


__all__ = ["ChunkPlan", "Region", "cuts", "host_view", "min_chunk", "plan_chunks", "runs"]
