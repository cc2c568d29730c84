"""Cutting a snapshot's tensors into chunk blobs, and reading chunk blobs back into freshly allocated arrays.

Writing: every tensor with a ``token_axis`` is cut at multiples of ``chunk_tokens``; the pieces of all caches for one
token range form one blob (tensor names ``"<cache>.<slot>.<slot name>"``). Tensors without a token axis form one more
blob. Pieces are zero-copy numpy views of the evaluated MLX arrays (bf16 through a uint16 view).

Reading: each destination MLX array is allocated once (``mx.zeros`` evaluated, then checked to own a full C-contiguous
buffer), a writable numpy view of it is taken, and blob tensors are ``preadv``-ed straight into the right slices; the
content hash is computed from that memory. Pieces that straddle the cut ``p`` or a non-contiguous region go through a
temporary buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..codecs.header import CacheEntry, TensorSlot
from ..errors import CorruptData
from .blobfile import Piece
from .manifest import BlobRef

_MX_STORAGE = {"bfloat16": mx.uint16}


def host_view(array: mx.array) -> np.ndarray:
    """A zero-copy numpy view of an evaluated MLX array (bf16 as uint16)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
        mx.eval(array)
    return np.array(array, copy=False)


def _region(host: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    return host[(slice(None),) * axis + (slice(start, stop),)]


def _as_piece(name: str, dtype: str, region: np.ndarray) -> Piece:
    if not region.flags["C_CONTIGUOUS"]:
        region = np.ascontiguousarray(region)
    return Piece(name, dtype, tuple(region.shape), memoryview(region).cast("B") if region.size else memoryview(b""))


@dataclass
class BlobPlan:
    """One blob to write: its pieces and the token range it covers ([0, 0) for the untokened blob)."""

    start: int
    stop: int
    pieces: list[Piece]


def plan_blobs(entries: list[CacheEntry], arrays: list[list[mx.array]], chunk_tokens: int) -> list[BlobPlan]:
    """Chunk blobs in token order, then (if any) the blob of tensors without a token axis."""
    hosts = [[host_view(a) for a in row] for row in arrays]
    extent = 0
    for entry, row in zip(entries, hosts):
        for slot, host in zip(entry.tensors, row):
            if slot.token_axis is not None:
                extent = max(extent, host.shape[slot.token_axis])
    plans = []
    for start in range(0, extent, chunk_tokens):
        stop = min(start + chunk_tokens, extent)
        pieces = []
        for i, (entry, row) in enumerate(zip(entries, hosts)):
            for j, (slot, host) in enumerate(zip(entry.tensors, row)):
                if slot.token_axis is None or host.shape[slot.token_axis] <= start:
                    continue
                region = _region(host, slot.token_axis, start, min(stop, host.shape[slot.token_axis]))
                pieces.append(_as_piece(f"{i}.{j}.{slot.name}", slot.dtype, region))
        plans.append(BlobPlan(start, stop, pieces))
    own = [
        _as_piece(f"{i}.{j}.{slot.name}", slot.dtype, host)
        for i, (entry, row) in enumerate(zip(entries, hosts))
        for j, (slot, host) in enumerate(zip(entry.tensors, row))
        if slot.token_axis is None
    ]
    if own:
        plans.append(BlobPlan(0, 0, own))
    return plans


class Destinations:
    """Owned MLX arrays for every slot of the (possibly cut) entries, with writable numpy views into them."""

    def __init__(self, entries: list[CacheEntry]):
        self.entries = entries
        self.arrays: list[list[mx.array]] = []
        self.hosts: list[list[np.ndarray]] = []
        fresh = []
        for entry in entries:
            row = []
            for slot in entry.tensors:
                dtype = mx.bool_ if slot.dtype == "bool" else getattr(mx, slot.dtype, None)
                if not isinstance(dtype, mx.Dtype):
                    raise CorruptData(f"slot {slot.name!r} has unknown dtype {slot.dtype!r}")
                row.append(mx.zeros(tuple(slot.shape), dtype=_MX_STORAGE.get(slot.dtype, dtype)))
            self.arrays.append(row)
            fresh.extend(row)
        mx.eval(fresh)
        for row in self.arrays:
            hosts = []
            for a in row:
                host = np.array(a, copy=False)
                if host.size and not (host.flags["C_CONTIGUOUS"] and host.flags["WRITEABLE"]
                                      and host.nbytes == a.nbytes):  # pragma: no cover - MLX invariant
                    raise RuntimeError("MLX returned a destination array that does not own its buffer")
                hosts.append(host)
            self.hosts.append(hosts)

    def slot(self, name: str) -> tuple[int, int, TensorSlot, np.ndarray]:
        try:
            i_text, j_text, _ = name.split(".", 2)
            i, j = int(i_text), int(j_text)
            return i, j, self.entries[i].tensors[j], self.hosts[i][j]
        except (ValueError, IndexError):
            raise CorruptData(f"blob tensor {name!r} names no slot of this snapshot") from None

    def finish(self) -> list[list[mx.array]]:
        return [[a.view(mx.bfloat16) if s.dtype == "bfloat16" else a for s, a in zip(e.tensors, row)]
                for e, row in zip(self.entries, self.arrays)]


def fill_from_blob(reader, ref: BlobRef, dest: Destinations) -> int:
    """Read one blob into its destinations (verifying the hash if the reader expects one); returns bytes read."""
    targets, copies = [], []
    for t in reader.tensors:
        i, j, slot, host = dest.slot(t.name)
        if slot.token_axis is None:
            if tuple(host.shape) != t.shape:
                raise CorruptData(f"blob {ref.hash}: tensor {t.name!r} has shape {t.shape}, expected {host.shape}")
            targets.append(memoryview(host).cast("B") if host.size else None)
            continue
        axis = slot.token_axis
        n_here = t.shape[axis] if len(t.shape) > axis else -1
        want_shape = host.shape[:axis] + (n_here,) + host.shape[axis + 1:]
        if n_here < 0 or t.shape != want_shape or ref.start + n_here > max(ref.stop, ref.start):
            raise CorruptData(f"blob {ref.hash}: tensor {t.name!r} has shape {t.shape}, expected {want_shape}")
        keep = max(0, min(n_here, host.shape[axis] - ref.start))
        region = _region(host, axis, ref.start, ref.start + keep)
        if keep == n_here and region.flags["C_CONTIGUOUS"] and region.size:
            targets.append(memoryview(region).cast("B"))
        else:
            targets.append(None)
            copies.append((len(targets) - 1, region, t.shape, keep, axis))
    bufs = reader.read_into(targets)
    for k, region, shape, keep, axis in copies:
        if keep:
            src = np.frombuffer(bufs[k], dtype=region.dtype).reshape(shape)
            region[...] = _region(src, axis, 0, keep)
    return reader.data_bytes


__all__ = ["host_view", "plan_blobs", "BlobPlan", "Destinations", "fill_from_blob"]
