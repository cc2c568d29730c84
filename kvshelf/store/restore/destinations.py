"""Reading chunks back into freshly allocated arrays: the destinations a restore fills (the save side, cutting
tensors into chunks, is ``save/chunking.py``).

Reading: each destination MLX array is allocated once (``mx.zeros`` evaluated, then checked to own a full C-contiguous
buffer), a writable numpy view of it is taken, and chunk tensors are ``preadv``-ed straight into the right slices; the
content hash is computed from that memory. Pieces that straddle the cut ``p`` or a non-contiguous region go through a
temporary buffer. A batched restore (``BatchDestinations``) allocates one array per tensor of each layer's codec
``BatchPlan`` instead, and each row's chunks are read into that row's window of it (``RowDestinations``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from msgspec.structs import replace

from ...codecs.batch_plan import BatchPlan
from ...codecs.header import CacheEntry, TensorSlot
from ...errors import CorruptData, KvShelfError
from ..index.schema import ChunkRef
from ..objects.chunkfile import axis_window

_MX_STORAGE = {"bfloat16": mx.uint16}


def slot_index(name: str) -> tuple[int, int]:
    """``(cache, slot)`` of a chunk tensor name ``"<cache>.<slot>.<name>"``."""
    try:
        i_text, j_text, _ = name.split(".", 2)
        i, j = int(i_text), int(j_text)
    except ValueError:
        raise CorruptData(f"chunk tensor {name!r} names no slot of this snapshot") from None
    if i < 0 or j < 0:
        raise CorruptData(f"chunk tensor {name!r} names no slot of this snapshot")
    return i, j


def owned_zeros(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[list[mx.array], list[np.ndarray]]:
    """Fresh evaluated zero MLX arrays for ``(name, dtype, shape)`` specs (bf16 stored as uint16) and writable
    numpy views of them, each checked to own a full C-contiguous buffer (so writes through it are the array)."""
    arrays = []
    for name, dtype_name, shape in specs:
        dtype = mx.bool_ if dtype_name == "bool" else getattr(mx, dtype_name, None)
        if not isinstance(dtype, mx.Dtype):
            raise CorruptData(f"slot {name!r} has unknown dtype {dtype_name!r}")
        arrays.append(mx.zeros(tuple(shape), dtype=_MX_STORAGE.get(dtype_name, dtype)))
    mx.eval(arrays)
    hosts = []
    for a in arrays:
        host = np.array(a, copy=False)
        if host.size and not (host.flags["C_CONTIGUOUS"] and host.flags["WRITEABLE"]
                              and host.nbytes == a.nbytes):  # pragma: no cover - MLX invariant
            raise KvShelfError("MLX returned a destination array that does not own its buffer")
        hosts.append(host)
    return arrays, hosts


def as_stored(dtype_name: str, array: mx.array) -> mx.array:
    return array.view(mx.bfloat16) if dtype_name == "bfloat16" else array


class Destinations:
    """Owned MLX arrays for every slot of the (possibly cut) entries, with writable numpy views into them."""

    def __init__(self, entries: list[CacheEntry]):
        self.entries = entries
        specs = [(slot.name, slot.dtype, tuple(slot.shape)) for entry in entries for slot in entry.tensors]
        flat, flat_hosts = owned_zeros(specs)
        self.arrays: list[list[mx.array]] = []
        self.hosts: list[list[np.ndarray]] = []
        at = 0
        for entry in entries:
            n = len(entry.tensors)
            self.arrays.append(flat[at:at + n])
            self.hosts.append(flat_hosts[at:at + n])
            at += n

    def slot(self, name: str) -> tuple[int, int, TensorSlot, np.ndarray]:
        """``(cache, slot index, slot, host)`` of a chunk tensor name ``"<cache>.<slot>.<name>"``."""
        i, j = slot_index(name)
        try:
            return i, j, self.entries[i].tensors[j], self.hosts[i][j]
        except IndexError:
            raise CorruptData(f"chunk tensor {name!r} names no slot of this snapshot") from None

    def finish(self) -> list[list[mx.array]]:
        return [[as_stored(s.dtype, a) for s, a in zip(e.tensors, row)] for e, row in zip(self.entries, self.arrays)]


class BatchDestinations:
    """One owned MLX array per tensor of each layer's ``BatchPlan``, which every row's chunks are read straight into;
    layers without a plan (None) get per-row ``Destinations`` as a serial restore does."""

    def __init__(self, plans: list[BatchPlan | None], rows: list[list[CacheEntry]]):
        self.plans, self.rows = plans, rows
        specs = [(t.name, t.dtype, t.shape) for plan in plans if plan is not None for t in plan.tensors]
        flat, flat_hosts = owned_zeros(specs)
        self.batched: list[list[mx.array] | None] = []
        self._hosts: list[list[np.ndarray] | None] = []
        self._targets = []
        at = 0
        for plan in plans:
            if plan is None:
                self.batched.append(None)
                self._hosts.append(None)
                self._targets.append(None)
                continue
            n = len(plan.tensors)
            self.batched.append(flat[at:at + n])
            self._hosts.append(flat_hosts[at:at + n])
            self._targets.append(plan.targets())
            at += n
        # unplanned layers: per-row arrays (planned layers' entries emptied so nothing is allocated for them)
        self.serial = [
            Destinations([e if plans[i] is None else replace(e, tensors=[]) for i, e in enumerate(entries)])
            for entries in rows
        ]

    def row(self, b: int) -> RowDestinations:
        return RowDestinations(self, b)

    def finish(self) -> list[tuple[list[mx.array] | None, list[list[mx.array]] | None]]:
        """Per layer ``(batched arrays, None)`` when planned, else ``(None, per-row arrays)``."""
        serial = [d.finish() for d in self.serial]
        out = []
        for i, plan in enumerate(self.plans):
            if plan is None:
                out.append((None, [rows[i] for rows in serial]))
            else:
                out.append(([as_stored(t.dtype, a) for t, a in zip(plan.tensors, self.batched[i])], None))
        return out


class RowDestinations:
    """Row ``b`` of a ``BatchDestinations`` seen as a serial ``Destinations``: a slot's host is the row's window of
    the batched tensor (``[1, ..., T_b, ...]`` at its start along the token axis), so chunk pieces land in place."""

    def __init__(self, batch: BatchDestinations, b: int):
        self.batch, self.b = batch, b
        self.entries = batch.rows[b]

    def slot(self, name: str) -> tuple[int, int, TensorSlot, np.ndarray]:
        i, j = slot_index(name)
        targets = self.batch._targets[i] if i < len(self.batch._targets) else None
        if targets is None:
            return self.batch.serial[self.b].slot(name)
        try:
            slot = self.entries[i].tensors[j]
        except IndexError:
            raise CorruptData(f"chunk tensor {name!r} names no slot of this snapshot") from None
        if (self.b, j) not in targets or slot.token_axis is None:
            raise CorruptData(f"chunk tensor {name!r} has no place in the batched layout")
        k, start = targets[(self.b, j)]
        batched = self.batch._hosts[i][k]
        window = batched[self.b:self.b + 1]
        window = axis_window(window, slot.token_axis, start, start + slot.shape[slot.token_axis])
        if window.shape != tuple(slot.shape):
            raise CorruptData(f"chunk tensor {name!r}: slot shape {slot.shape} does not fit the batched "
                              f"{list(batched.shape)} at {start}")
        return i, j, slot, window


def fill_from_chunk(reader, ref: ChunkRef, dest: Destinations) -> int:
    """Read one chunk into its destinations (verifying the hash if the reader expects one); returns bytes read."""
    targets, copies = [], []
    for t in reader.tensors:
        i, j, slot, host = dest.slot(t.name)
        if slot.token_axis is None:
            if tuple(host.shape) != t.shape:
                raise CorruptData(f"chunk {ref.hash}: tensor {t.name!r} has shape {t.shape}, expected {host.shape}")
            targets.append(memoryview(host).cast("B") if host.size else None)
            continue
        axis = slot.token_axis
        n_here = t.shape[axis] if len(t.shape) > axis else -1
        want_shape = host.shape[:axis] + (n_here,) + host.shape[axis + 1:]
        if n_here < 0 or t.shape != want_shape or ref.start + n_here > max(ref.stop, ref.start):
            raise CorruptData(f"chunk {ref.hash}: tensor {t.name!r} has shape {t.shape}, expected {want_shape}")
        keep = max(0, min(n_here, host.shape[axis] - ref.start))
        region = axis_window(host, axis, ref.start, ref.start + keep)
        if keep == n_here and region.flags["C_CONTIGUOUS"] and region.size:
            targets.append(memoryview(region).cast("B"))
        else:
            targets.append(None)
            copies.append((len(targets) - 1, region, t.shape, keep, axis))
    bufs = reader.read_into(targets)
    for k, region, shape, keep, axis in copies:
        if keep:
            src = np.frombuffer(bufs[k], dtype=region.dtype).reshape(shape)
            region[...] = axis_window(src, axis, 0, keep)
    return reader.data_bytes


__all__ = ["BatchDestinations", "Destinations", "RowDestinations", "as_stored", "fill_from_chunk", "owned_zeros",
           "slot_index"]
