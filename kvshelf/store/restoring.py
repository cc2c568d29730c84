"""The restore path: chunk bytes ``preadv``-ed straight into the final MLX arrays, hashed while hot, no fsync.

Why ``mx.load`` over a virtual file: MLX has no way to hand out an owned, uninitialised, writable buffer (``mx.zeros``
touches every page, then the read touches it again: measured 1.5–2× slower at 512 MiB). ``mx.load`` of a file-like
object allocates each tensor uninitialised and fills it with ONE ``readinto(memoryview)`` call into its own buffer.
So the destinations are described as a safetensors header (``VirtualFile``) and each ``readinto`` scatters the
chunk pieces of that tensor into it: a ``[1, H, t, D]`` piece of a ``[1, H, T, D]`` plane goes to its H head runs in
one ``preadv``, no temporary, no zero fill. Pieces are hashed right after they land (per-chunk running xxh3-128,
tensors evaluated in chunk order, so each hash is fed in order; a piece that arrives early is hashed from its
destination once its predecessors are in). Only a piece straddling a prefix cut goes through a temporary.

Errors inside ``readinto`` (a corrupt or missing chunk) are kept and re-raised after ``mx.eval`` returns: the arrays
of a failed read are dropped, never returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import CorruptData
from .backend import ObjectMissing
from .blobfile import BlobReader, storage_dtype
from .layout import slot_index
from .localbytes import open_object
from .manifest import BlobRef
from .piecereads import ChunkHash, read_parallel, read_piece
from .virtualfile import VirtualFile


@dataclass
class Read:
    """One snapshot being read: its (cut) entries, the chunks covering the cut, where they lie, the lease."""

    manifest: object
    entries: list
    needed: list[BlobRef]
    lease: bytes | None
    where: dict[str, tuple[str, int, int | None]] = field(default_factory=dict)
    ok: bool = False


BEFORE_OPEN: list = []  # test seam: callables run with an object's name between finding a chunk and opening it


def before_open(name: str) -> None:
    """Run the test seam's hooks (none outside tests): lets a test force a re-encoding into that window."""
    for hook in list(BEFORE_OPEN):
        hook(name)


class Objects:
    """Readers of the objects one restore touches, opened once each."""

    def __init__(self, byte_store):
        self.byte_store, self._open = byte_store, {}

    def get(self, name: str):
        r = self._open.get(name)
        if r is None:
            before_open(name)
            try:
                r = self._open[name] = open_object(self.byte_store, name)
            except ObjectMissing:
                raise CorruptData(f"chunk object {name} is missing") from None
        return r

    def chunk(self, ref: BlobRef, where: tuple[str, int, int | None], verify: bool) -> BlobReader:
        name, offset, length = where
        return BlobReader(None, ref.hash if verify else None, source=self.get(name), base=offset, length=length,
                          where=ref.hash, owns_source=False)

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
        self.pieces: list[tuple[int, BlobRef, int]] = []  # (chunk index, ref, tensor index within the chunk)

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
    readers: list[BlobReader] = []
    hashes: list[ChunkHash] = []
    try:
        for c, ref in enumerate(read.needed):
            reader = objects.chunk(ref, read.where[ref.hash], verify)
            readers.append(reader)
            hashes.append(ChunkHash(reader, verify))
            advise = getattr(reader.source, "willneed", None)
            if advise is not None:
                advise(reader.base, reader.length)
            for k, t in enumerate(reader.tensors):
                i, j = slot_index(t.name)
                try:
                    dest = by_slot[i][j]
                except IndexError:
                    raise CorruptData(f"blob {ref.hash}: tensor {t.name!r} names no slot of this snapshot") from None
                dest.pieces.append((c, ref, k))
        check_coverage(read, slots, readers)  # before mx.load allocates a single destination
        decompressed: dict[int, memoryview] = {}

        def fill(slot: _Slot, dest: memoryview) -> None:
            _fill_slot(slot, dest, readers, hashes, decompressed)

        flat = [s for row in slots for s in row if s.nbytes]
        flat.sort(key=lambda s: (s.i, -1 if s.j is None else s.j))  # entry slot order: chunk header order
        vf = VirtualFile(flat, fill)
        loaded = mx.load(vf, format="safetensors") if flat else {}
        out: list[list] = [[None] * len(row) for row in slots]
        index = {id(s): (i, k) for i, row in enumerate(slots) for k, s in enumerate(row)}
        for s in flat:  # one at a time, so every chunk's tensors arrive in header order (hashed in order)
            a = loaded[s.key]
            mx.eval(a)
            if vf.error is not None:
                raise vf.error
            i, k = index[id(s)]
            out[i][k] = a
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


def check_coverage(read: Read, slots: list[list[_Slot]], readers: list[BlobReader]) -> None:
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
    from .layout import as_stored, owned_zeros

    arrays, _ = owned_zeros([(s.key, s.dtype, s.shape)])
    return as_stored(s.dtype, arrays[0])


def _fill_slot(slot: _Slot, dest: memoryview, readers, hashes, decompressed) -> None:
    axis = slot.axis
    if slot.padded:  # zero what no piece covers (a planned tensor's columns around the row, or all of it)
        host = np.frombuffer(dest, np.uint8)
        if slot.slot is None or axis is None:
            host[:] = 0
        else:
            outer = math.prod(slot.shape[:axis])
            inner = math.prod(slot.shape[axis + 1:]) * slot.itemsize
            grid = host.reshape(outer, slot.shape[axis] * inner)
            grid[:, :slot.col0 * inner] = 0
            grid[:, (slot.col0 + slot.length) * inner:] = 0
    direct: list = []  # raw pieces: read in parallel below, then hashed in order
    for c, ref, k in slot.pieces:
        reader = readers[c]
        t = reader.tensors[k]
        want_full = tuple(int(d) for d in slot.slot.shape)
        if axis is None:
            if t.shape != want_full:
                raise CorruptData(f"blob {ref.hash}: tensor {t.name!r} has shape {t.shape}, expected {want_full}")
            views = [dest]
            keep = n_here = 1
        else:
            n_here = t.shape[axis] if len(t.shape) > axis else -1
            want = want_full[:axis] + (n_here,) + want_full[axis + 1:]
            if n_here < 0 or t.shape != want or ref.start + n_here > max(ref.stop, ref.start):
                raise CorruptData(f"blob {ref.hash}: tensor {t.name!r} has shape {t.shape}, expected {want}")
            keep = max(0, min(n_here, slot.length - ref.start))
            outer = math.prod(slot.shape[:axis])
            inner = math.prod(slot.shape[axis + 1:]) * slot.itemsize
            span = slot.shape[axis] * inner
            at = (slot.col0 + ref.start) * inner
            views = [dest[o * span + at:o * span + at + keep * inner] for o in range(outer)]
        if keep == n_here:
            if reader.compressed:
                read_piece(reader, c, k, views, decompressed)
                hashes[c].feed(k, views)
            else:
                direct.append((reader, c, k, views))
        else:  # straddles the cut: whole piece to a temporary (it is hashed whole), keep the head of each run
            tmp = memoryview(bytearray(t.nbytes))
            read_piece(reader, c, k, [tmp], decompressed)
            hashes[c].feed(k, [tmp])
            run = n_here * inner
            for o, v in enumerate(views):
                v[:] = tmp[o * run:o * run + v.nbytes]
    read_parallel(direct, hashes)


__all__ = ["Objects", "Read", "VirtualFile", "check_coverage", "read_direct"]
