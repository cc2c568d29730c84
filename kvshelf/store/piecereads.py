"""Chunk pieces read into their destinations and hashed where they land (the restore's inner loop).

Why a room of its own: this is the part of a restore that touches every byte, so it is where the speed is decided.
``preadv`` puts a piece's bytes straight into the head runs of its final MLX array; the thread that read a piece
hashes it right away (bytes still in that core's cache), into the piece's chunk's running xxh3-128
(``ChunkHash``), with the GIL released (``runhash``) so both cores work. A chunk's hash is fed tensor by tensor in
header order; a piece that arrives early is kept until its predecessors are in.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..errors import CorruptData
from .blobfile import BlobReader, descriptor
from .runhash import RunHash


class ChunkHash:
    """The running content hash of one chunk, fed tensor by tensor in header order."""

    def __init__(self, reader: BlobReader, verify: bool):
        self.reader, self.verify = reader, verify
        self.h = RunHash(descriptor(reader.tensors)) if verify else None
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
            raise CorruptData(f"blob {self.reader.where}: {len(self.reader.tensors) - self.next} tensors were never "
                              f"read (they name no slot of this snapshot)")
        got = self.h.hexdigest()
        if got != self.reader.expect_hash:
            raise CorruptData(f"blob {self.reader.where}: content hash {got} does not match its name "
                              f"{self.reader.expect_hash}")


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()
READ_THREADS = max(1, min(4, os.cpu_count() or 1))


def read_parallel(pieces: list, hashes: list[ChunkHash]) -> None:
    """``preadv`` the pieces of one destination tensor on ``READ_THREADS`` threads and hash each piece on the thread
    that read it, right after it landed (``preadv`` and xxh3 both release the GIL): the copy into fresh pages is
    bounded by page faults, which one core alone takes at half the machine's speed, and the hash then reads bytes
    still in that core's cache instead of a second pass over memory. Pieces are dealt to threads by chunk, so a
    chunk's running hash is only ever fed by one thread, in order (one slot holds one piece per chunk)."""
    global _POOL
    if len(pieces) < 2 or READ_THREADS == 1:
        _read_and_hash(pieces, hashes)
        return
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():  # a forked child gets its own threads
            _POOL = (os.getpid(), ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvshelf-read"))
        pool = _POOL[1]
    groups: list[list] = [[] for _ in range(READ_THREADS)]
    for item in pieces:
        groups[item[1] % READ_THREADS].append(item)
    futures = [pool.submit(_read_and_hash, g, hashes) for g in groups[1:] if g]
    try:
        _read_and_hash(groups[0], hashes)
    finally:
        errors = [f.exception() for f in futures]  # every thread done before the caller sees anything
    for exc in errors:
        if exc is not None:
            raise exc


def _read_and_hash(pieces: list, hashes: list[ChunkHash]) -> None:
    for reader, c, k, views in pieces:
        _read_raw(reader, k, views)
        hashes[c].feed(k, views)


def _read_raw(reader: BlobReader, k: int, views: list[memoryview]) -> None:
    t = reader.tensors[k]
    try:
        reader.source.read_into(reader.data_start + t.start, views)
    except CorruptData:
        raise CorruptData(f"blob {reader.where} is truncated (tensor data ends early)") from None


def read_piece(reader: BlobReader, c: int, k: int, views: list[memoryview], decompressed) -> None:
    t = reader.tensors[k]
    if not reader.compressed:
        try:
            reader.source.read_into(reader.data_start + t.start, views)
        except CorruptData:
            raise CorruptData(f"blob {reader.where} is truncated (tensor data ends early)") from None
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



__all__ = ["ChunkHash", "READ_THREADS", "read_parallel", "read_piece"]
