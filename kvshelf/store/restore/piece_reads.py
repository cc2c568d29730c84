"""Chunk pieces read into their destinations and hashed where they land (the restore's inner loop).

Why a room of its own: this is the part of a restore that touches every byte, so it is where the speed is decided.
``preadv`` puts a piece's bytes straight into the head runs of its final MLX array; the thread that read a piece
hashes it right away (bytes still in that core's cache), into the piece's chunk's running xxh3-128
(``ChunkHash``). A chunk's hash is fed tensor by tensor in header order; a piece that arrives early is kept until
its predecessors are in.

Why the ``xxhash`` object and not the GIL-free ``runhash.RunHash``: on cache-hot 64–128 KiB runs the object hashes
at ~50 GB/s (1.3–2.5 µs a call, holding the GIL that briefly), while xxHash's exported C API through ``ctypes``
runs at ~26 GB/s plus ~1.5 µs of call overhead. The other reader thread spends its time in ``preadv`` with the GIL
released, so the short GIL holds cost less than the slower parallel hash (in-process A/B, 512 MiB KV f16: 195 ->
160 ms with checksums, 143 ms without; MLA f32 L: 42 -> 37 ms, 28 ms without).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from ...errors import CorruptData
from ..objects.chunkfile import ChunkReader, descriptor


class ChunkHash:
    """The running content hash of one chunk, fed tensor by tensor in header order."""

    def __init__(self, reader: ChunkReader, verify: bool):
        self.reader, self.verify = reader, verify
        self.h = xxhash.xxh3_128(descriptor(reader.tensors)) if verify else None
        self.next = 0
        self.early: dict[int, list[memoryview]] = {}

    def feed(self, k: int, views: list[memoryview]) -> None:
        if self.h is None:
            return
        if k != self.next:
            self.early[k] = views
            return
        for v in views:
            self.h.update(v)
        self.next += 1
        while self.next in self.early:
            for v in self.early.pop(self.next):
                self.h.update(v)
            self.next += 1

    def check(self) -> None:
        if self.h is None:
            return
        if self.next != len(self.reader.tensors):
            raise CorruptData(f"chunk {self.reader.where}: {len(self.reader.tensors) - self.next} tensors were never "
                              f"read (they name no slot of this snapshot)")
        got = self.h.hexdigest()
        if got != self.reader.expect_hash:
            raise CorruptData(f"chunk {self.reader.where}: content hash {got} does not match its name "
                              f"{self.reader.expect_hash}")


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()
READ_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclass
class PieceJob:
    """Where tensor ``k`` of a chunk goes: the destination ``views`` (its runs, in C order), or — a piece
    straddling a prefix cut (``keep`` < its length) — a temporary whose head of each run is kept."""

    k: int
    views: list
    straddle: tuple[int, int] | None = None  # (run bytes in the piece, kept bytes per run)


BATCH_BYTES = 256 << 10  # bytes per preadv before hashing them: still in this core's cache when hashed
RAW_BATCH_BYTES = 4 << 20  # bytes per preadv when nothing is hashed (fewer calls; measured 120 -> 108 ms, 512 MiB)
# (measured at 512 MiB, verification on: 256 KiB batches 168 ms, 1 MiB 182 ms, 4 MiB 199 ms — the hash's re-read
# misses the cache once a batch outgrows what the core keeps)


def fill_chunks(jobs: list[list[PieceJob]], readers: list[ChunkReader], hashes: list[ChunkHash],
                after: list | None = None) -> None:
    """Read every chunk's pieces into their destinations in FILE order (chunk by chunk, tensors in header order),
    on ``READ_THREADS`` threads dealt whole chunks: a cold pack is read front to back (readahead works, no seek per
    layer), a warm one is a few large ``preadv`` calls per chunk, and each chunk's running hash is fed by the one
    thread that owns it, in order. ``after``: callables touching memory no piece is read into (the zeroing of
    padding), shared out among the threads once their chunks are read. Every thread finishes before the first
    error is raised."""
    global _POOL
    order = [c for c in range(len(jobs)) if jobs[c]]
    after = after or []
    if len(order) < 2 or READ_THREADS == 1:
        for c in order:
            _fill_chunk(readers[c], jobs[c], hashes[c])
        for fn in after:
            fn()
        return
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():  # a forked child gets its own threads
            _POOL = (os.getpid(), ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvshelf-read"))
        pool = _POOL[1]
    groups: list[list[int]] = [order[t::READ_THREADS] for t in range(READ_THREADS)]
    shares = [after[t::READ_THREADS] for t in range(READ_THREADS)]

    def run(t: int) -> None:
        for c in groups[t]:
            _fill_chunk(readers[c], jobs[c], hashes[c])
        for fn in shares[t]:
            fn()

    futures = [pool.submit(run, t) for t in range(1, READ_THREADS) if groups[t] or shares[t]]
    try:
        run(0)
    finally:
        errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None:
            raise exc


def _fill_chunk(reader: ChunkReader, jobs: list[PieceJob], h: ChunkHash) -> None:
    batch: list[PieceJob] = []
    start = end = size = 0
    decompressed: dict = {}
    limit = BATCH_BYTES if h.h is not None else RAW_BATCH_BYTES

    def flush() -> None:
        nonlocal batch, size
        if batch:
            try:
                reader.source.read_into(start, [v for job in batch for v in job.views])
            except CorruptData:
                raise CorruptData(f"chunk {reader.where} is truncated (tensor data ends early)") from None
            for job in batch:
                h.feed(job.k, job.views)
        batch, size = [], 0

    for job in sorted(jobs, key=lambda j: j.k):
        t = reader.tensors[job.k]
        if reader.compressed or job.straddle is not None:
            flush()
            if job.straddle is None:
                read_piece(reader, 0, job.k, job.views, decompressed)
                h.feed(job.k, job.views)
                continue
            run, kept = job.straddle  # whole piece to a temporary (it is hashed whole), keep each run's head
            tmp = memoryview(bytearray(t.nbytes))
            read_piece(reader, 0, job.k, [tmp], decompressed)
            h.feed(job.k, [tmp])
            for o, v in enumerate(job.views):
                v[:] = tmp[o * run:o * run + kept]
            continue
        at = reader.data_start + t.start
        if batch and (at != end or size >= limit):
            flush()
        if not batch:
            start = at
        batch.append(job)
        end = reader.data_start + t.stop
        size += t.nbytes
    flush()


def read_piece(reader: ChunkReader, c: int, k: int, views: list[memoryview], decompressed) -> None:
    t = reader.tensors[k]
    if not reader.compressed:
        try:
            reader.source.read_into(reader.data_start + t.start, views)
        except CorruptData:
            raise CorruptData(f"chunk {reader.where} is truncated (tensor data ends early)") from None
        return
    payload = decompressed.get(c)
    if payload is None:
        bufs = [memoryview(bytearray(x.nbytes)) for x in reader.tensors]
        saved, reader.expect_hash = reader.expect_hash, None  # hashed piece by piece by the caller
        try:
            reader._decompress_into([[b] for b in bufs], reader.where)
        finally:
            reader.expect_hash = saved
        payload = decompressed[c] = memoryview(b"".join(bufs))
    src = payload[t.start:t.stop]
    at = 0
    for v in views:
        v[:] = src[at:at + v.nbytes]
        at += v.nbytes



__all__ = ["BATCH_BYTES", "RAW_BATCH_BYTES", "ChunkHash", "PieceJob", "READ_THREADS", "fill_chunks", "read_piece"]
