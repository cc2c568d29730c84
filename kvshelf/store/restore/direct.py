"""The restore path: every destination allocated uninitialised, then chunk bytes ``preadv``-ed straight into it in
file order, hashed where they land, no fsync.

Why ``mx.load`` over a virtual file: MLX has no way to hand out an owned, uninitialised, writable buffer (``mx.zeros``
touches every page, then the read touches it again: measured 1.5–2× slower at 512 MiB). ``mx.load`` of a file-like
object allocates each tensor uninitialised and calls ``readinto(memoryview)`` once with its own buffer. So the
destinations are described as a safetensors header (``VirtualFile``); each ``readinto`` only records where that
tensor's pieces go (``_plan_slot``: a ``[1, H, t, D]`` piece of a ``[1, H, T, D]`` plane is H head runs) and zeroes
what no piece covers. Once every destination exists, ``piece_reads.fill_chunks`` reads chunk after chunk in the order
they lie in the pack — not layer after layer, which would hop across the pack once per layer and defeat readahead on
a cold read — a few large ``preadv`` calls per chunk on two threads, each chunk hashed by the thread that read it.
Only a piece straddling a prefix cut goes through a temporary.

Errors (a corrupt, short or missing chunk) are raised only after every reader thread has stopped, and the arrays of
a failed read are dropped, never returned.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ...errors import CorruptData
from ..base import seams
from . import hugepages
from ..objects.protocol import ObjectMissing
from ..objects.chunkfile import ChunkReader, storage_dtype
from .destinations import as_stored, owned_zeros, slot_index
from ..objects.protocol import open_object
from ..index.schema import ChunkRef
from .piece_reads import ChunkHash, PieceJob, fill_chunks
from .virtualfile import VirtualFile


@dataclass
class Read:
    """One snapshot being read: its (cut) entries, the chunks covering the cut, where they lie, the lease."""

    manifest: object
    entries: list
    needed: list[ChunkRef]
    lease: bytes | None
    where: dict[str, tuple[str, int, int | None]] = field(default_factory=dict)
    ok: bool = False




class Objects:
    """Readers of the objects one restore touches, opened once each."""

    def __init__(self, byte_store, keys=None):
        self.byte_store, self._open, self.keys = byte_store, {}, keys

    def get(self, name: str):
        r = self._open.get(name)
        if r is None:
            seams.BEFORE_OPEN(name)  # a test may force a re-encoding into this window
            try:
                r = self._open[name] = open_object(self.byte_store, name)
            except ObjectMissing:
                raise CorruptData(f"chunk object {name} is missing") from None
        return r

    def chunk(self, ref: ChunkRef, where: tuple[str, int, int | None], verify: bool) -> ChunkReader:
        name, offset, length = where
        return ChunkReader(None, ref.hash if verify else None, source=self.get(name), base=offset, length=length,
                          where=ref.hash, owns_source=False, keys=self.keys, name=ref.hash)

    def close(self) -> None:
        for r in self._open.values():
            r.close()
        self._open.clear()


class _Slot:
    """One destination tensor and the chunk pieces that fill it: a slot of the entry as it is, or (``plan``) a
    tensor of the layer's single-row batch plan — ``[1, H, capacity, D]`` with the slot's ``T`` positions at column
    ``col0`` and zeros around them (what ``merge_row_states`` would build by copying; ``adopt_batch`` takes it as
    it is)."""

    def __init__(self, i: int, j: int, slot, *, shape=None, dtype: str | None = None, col0: int = 0,
                 key: str | None = None):
        self.i, self.j, self.slot = i, j, slot
        self.key = key or f"{i}.{j}"
        self.dtype = dtype or slot.dtype
        self.shape = tuple(int(d) for d in (shape if shape is not None else slot.shape))
        self.axis = slot.token_axis if slot is not None else None
        self.length = int(slot.shape[self.axis]) if slot is not None and self.axis is not None else 0
        self.col0 = col0
        self.itemsize = storage_dtype(self.dtype).itemsize
        self.nbytes = math.prod(self.shape) * self.itemsize
        self.pieces: list[tuple[int, ChunkRef, int]] = []  # (chunk index, ref, tensor index within the chunk)

    @property
    def padded(self) -> bool:
        return self.slot is None or (self.axis is not None and self.shape[self.axis] != self.length)


def read_direct(objects: Objects, read: Read, verify: bool, plans: list | None = None
                ) -> tuple[list[list[mx.array]], int, int]:
    """Every destination of ``read.entries`` as a freshly loaded MLX array — per layer the slots as they are, or
    the tensors of ``plans[layer]`` (a single-row ``BatchPlan``) — returns (arrays per layer, chunks, bytes read)."""
    slots: list[list[_Slot]] = []   # per layer: the destinations, in the order the caller gets them
    by_slot: list[list[_Slot | None]] = []  # per layer and entry slot: the destination its pieces go to
    for i, e in enumerate(read.entries):
        plan = plans[i] if plans is not None else None
        if plan is None:
            row = [_Slot(i, j, s) for j, s in enumerate(e.tensors)]
            slots.append(row)
            by_slot.append(list(row))
            continue
        targets = {j: kt for (b, j), kt in plan.targets().items() if b == 0}
        row = [_Slot(i, None, None, shape=t.shape, dtype=t.dtype, key=f"{i}.p{k}") for k, t in enumerate(plan.tensors)]
        mapped: list[_Slot | None] = []
        for j, s in enumerate(e.tensors):
            k, start = targets[j]
            dest = row[k]
            dest.slot, dest.j, dest.axis, dest.col0 = s, j, plan.tensors[k].token_axis, start
            dest.length = int(s.shape[dest.axis])
            mapped.append(dest)
        slots.append(row)
        by_slot.append(mapped)
    readers: list[ChunkReader] = []
    hashes: list[ChunkHash] = []
    try:
        for c, ref in enumerate(read.needed):
            reader = objects.chunk(ref, read.where[ref.hash], verify)
            readers.append(reader)
            hashes.append(ChunkHash(reader, verify))
            for k, t in enumerate(reader.tensors):
                i, j = slot_index(t.name)
                try:
                    dest = by_slot[i][j]
                except IndexError:
                    raise CorruptData(f"chunk {ref.hash}: tensor {t.name!r} names no slot of this snapshot") from None
                dest.pieces.append((c, ref, k))
        check_coverage(read, slots, readers)  # before mx.load allocates a single destination
        will_need(objects, read)  # the disk starts streaming every range while the destinations are allocated
        flat = [s for row in slots for s in row if s.nbytes]
        jobs: list[list[PieceJob]] = [[] for _ in readers]
        zeroing: list = []

        def allocated(slot: _Slot, dest: memoryview) -> None:  # inside mx.load: uninitialised, nothing read yet
            hugepages.advise(dest)  # before the first touch: faulted in 2 MiB pages where the kernel offers them
            _plan_slot(slot, _detached(dest), readers, jobs, zeroing)

        vf = VirtualFile(flat, allocated)
        loaded = mx.load(vf, format="safetensors") if flat else {}
        mx.eval([loaded[s.key] for s in flat])  # every destination allocated; then filled in file order
        if vf.error is not None:
            raise vf.error
        fill_chunks(jobs, readers, hashes, after=zeroing)  # padding zeroed by the reader threads, after their reads
        out: list[list] = [[None] * len(row) for row in slots]
        index = {id(s): (i, k) for i, row in enumerate(slots) for k, s in enumerate(row)}
        for s in flat:
            i, k = index[id(s)]
            out[i][k] = loaded[s.key]
        for i, row in enumerate(slots):
            for k, s in enumerate(row):
                if not s.nbytes:
                    out[i][k] = _empty(s)
                    for c, _ref, kk in s.pieces:
                        hashes[c].feed(kk, [])
        for ch in hashes:
            ch.check()
        return out, len(readers), sum(r.data_bytes for r in readers)
    finally:
        for r in readers:
            r.close()


def will_need(objects: Objects, read: Read) -> None:
    """Name every byte range this restore will read to its object up front (``LocalReader.will_need``: the
    kernel reads them ahead, so a cold restore streams at the disk's speed instead of trickling through the
    readahead of two interleaved reader threads), merged per object into contiguous spans."""
    spans: dict[str, list[list[int]]] = {}
    for ref in read.needed:
        name, offset, length = read.where[ref.hash]
        if not length:
            spans.setdefault(name, []).append([offset, 0])  # a whole v1 chunk file: to its end
            continue
        runs = spans.setdefault(name, [])
        if runs and runs[-1][1] and runs[-1][0] + runs[-1][1] == offset:
            runs[-1][1] += length
        else:
            runs.append([offset, length])
    for name, runs in spans.items():
        hint = getattr(objects.get(name), "will_need", None)
        if hint is not None:
            for offset, length in runs:
                hint(offset, length)


def check_coverage(read: Read, slots: list[list[_Slot]], readers: list[ChunkReader]) -> None:
    """Σ bytes the chunks bring to each destination = the bytes its slot declares (≥ for a cut restore, whose
    last chunk reaches past the cut) — checked from the chunk headers alone, before anything is allocated, so a
    record whose shapes do not match its chunks is ``CorruptData`` and never a huge or half-filled allocation."""
    cut = any(e.offset != read.manifest.length for e in read.entries) if read.entries else False
    for row in slots:
        for s in row:
            if s.slot is None:
                continue
            want = math.prod(int(d) for d in s.slot.shape) * s.itemsize
            got = sum(math.prod(readers[c].tensors[k].shape) * storage_dtype(readers[c].tensors[k].dtype).itemsize
                      for c, _ref, k in s.pieces)
            if got != want and not (cut and got > want and s.axis is not None):
                raise CorruptData(f"snapshot {read.manifest.snapshot_id} (session {read.manifest.session_id!r}): "
                                  f"tensor {s.key} declares {want} bytes {list(s.slot.shape)} but its chunks hold "
                                  f"{got}: the record does not match its chunks")


def _empty(s: _Slot) -> mx.array:
    arrays, _ = owned_zeros([(s.key, s.dtype, s.shape)])
    return as_stored(s.dtype, arrays[0])


def _detached(dest: memoryview) -> memoryview:
    """A view of the same memory as ``dest`` that outlives the ``readinto`` call MLX made with it: the memory is
    the loaded array's own buffer, alive as long as the array (which ``read_direct`` holds until it returns)."""
    addr = np.frombuffer(dest, np.uint8).ctypes.data
    return memoryview((ctypes.c_char * dest.nbytes).from_address(addr)).cast("B")


def _plan_slot(slot: _Slot, dest: memoryview, readers: list[ChunkReader], jobs: list[list[PieceJob]],
               zeroing: list) -> None:
    """Give each of the slot's pieces its destination runs (``jobs[chunk]``) and queue the zeroing of what no piece
    covers (``zeroing``: run after the reads); the shapes in the chunk headers are checked here, before a byte is
    read. Why the zeroing waits: the padding of a ``[1, H, capacity, D]`` plan sits in every head row, so zeroing
    it first would fault in (and have the kernel clear) nearly every page of the destination on this one thread;
    after the reads, the reader threads have faulted the pages in parallel and share out the remaining memset
    (warm 512 MiB KV restores: 147-791 ms before, against 125-134 ms for the same bytes unpadded)."""
    axis = slot.axis
    if slot.padded:  # zero what no piece covers (a planned tensor's columns around the row, or all of it)
        zeroing.append(lambda: _zero_uncovered(slot, dest))
    for c, ref, k in slot.pieces:  # disjoint from what _zero_uncovered clears
        t = readers[c].tensors[k]
        want_full = tuple(int(d) for d in slot.slot.shape)
        if axis is None:
            if t.shape != want_full:
                raise CorruptData(f"chunk {ref.hash}: tensor {t.name!r} has shape {t.shape}, expected {want_full}")
            jobs[c].append(PieceJob(k, [dest]))
            continue
        n_here = t.shape[axis] if len(t.shape) > axis else -1
        want = want_full[:axis] + (n_here,) + want_full[axis + 1:]
        if n_here < 0 or t.shape != want or ref.start + n_here > max(ref.stop, ref.start):
            raise CorruptData(f"chunk {ref.hash}: tensor {t.name!r} has shape {t.shape}, expected {want}")
        keep = max(0, min(n_here, slot.length - ref.start))
        outer = math.prod(slot.shape[:axis])
        inner = math.prod(slot.shape[axis + 1:]) * slot.itemsize
        span = slot.shape[axis] * inner
        at = (slot.col0 + ref.start) * inner
        views = [dest[o * span + at:o * span + at + keep * inner] for o in range(outer)]
        jobs[c].append(PieceJob(k, views, None if keep == n_here else (n_here * inner, keep * inner)))


def _zero_uncovered(slot: _Slot, dest: memoryview) -> None:
    host = np.frombuffer(dest, np.uint8)
    if slot.slot is None or slot.axis is None:  # a plan tensor no slot fills
        host[:] = 0
        return
    outer = math.prod(slot.shape[:slot.axis])
    inner = math.prod(slot.shape[slot.axis + 1:]) * slot.itemsize
    grid = host.reshape(outer, slot.shape[slot.axis] * inner)
    grid[:, :slot.col0 * inner] = 0
    grid[:, (slot.col0 + slot.length) * inner:] = 0


__all__ = ["Objects", "Read", "VirtualFile", "check_coverage", "read_direct"]
