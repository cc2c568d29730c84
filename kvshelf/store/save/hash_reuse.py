"""Skip-unchanged hashing: a grown session's save reuses the chunk hashes of its last save instead of re-hashing
the positions it already stored.

Why: a save names every chunk by its content hash to dedupe it against the index, and hashing is most of what a
``+256`` save of a 4,096-token session costs (16 of its 17 chunks are stored already). A hash may be reused only
when it provably names the same bytes, and only the cache can prove that: kvshelf's caches keep an edit epoch
(``latent_legos.contracts.EditEpoch``) that changes on every operation that may alter a stored position and stays
across appends at the end. mlx-lm's classes have no such hook (and kvshelf does not patch them), so their chunks are
always hashed.

What a handle remembers (process memory only, ``CAPACITY`` sessions, least recently saved dropped first): for the
last save of each (namespace, session) its snapshot id and, per layer, a weak reference to the cache object, its
epoch and offset; per token window the chunk's exact descriptor (names, dtypes, shapes) and hash. At the next save
of that session a window's old hash is reused only if all of this holds, else the window is hashed:

* the session's current snapshot in the index is still the remembered one (one read in the save's transaction);
* every layer with a token axis is the SAME object (alive), implements the epoch and has the same epoch as then;
* the window lies entirely below every such layer's previous offset (so the window straddling the old offset and
  every new one are hashed), and its descriptor is byte-identical to the remembered one.

The chunk without a token axis (rotating rings, recurrent state, paged pools) is always hashed; layers that have
no token axis contribute only to it, so their objects are not compared. A reused hash is still looked up in the
index like any other: a chunk no longer indexed is written again from the current pieces. Epoch and offset are
read at capture, before the snapshot, and checked again after it is evaluated, so ``save_async`` compares two
captures, never a capture with a later state. ``store.counters`` counts ``chunks_hashed`` / ``bytes_hashed`` and
``chunks_hash_reused`` / ``bytes_hash_reused`` so tests count the work.

mlx-lm's classes (``KVCache``, ``QuantizedKVCache`` — packed data, scales and biases alike — and ``RotatingKVCache``
before its ring wraps, stored as rows; any cache without the epoch): their stored windows are
*verified*, never trusted. Nothing short of the bytes can prove a window of such a cache unchanged: the object, its
arrays and even the data pointer stay the same across ``trim`` + ``update_and_fetch`` (MLX donates the buffer to
the slice update, so a rewritten row lands in the very memory that was saved), and a sample of rows misses the row
it did not sample. Keeping the saved bytes to compare would double the cache's memory and, by holding the buffer,
stop MLX donating it to the next decode step (a full copy per step). So each window the remembered save stored is
hashed again (xxh3-128 of descriptor + bytes, the chunk's own name, so "verified" means exactly what dedupe means
everywhere else in the store) and a window whose hash differs is a new chunk, written like any other: a changed row
can never be taken as unchanged. What makes it cheap is where it runs: ``ChunkHasher.hashed`` hashes the windows on a
pool of threads (``RunHash`` releases the GIL), the windows the remembered save did not store first, so the new
rows are written while the stored ones are being verified. ``chunks_verified`` / ``bytes_verified`` count the
verified windows (a part of ``chunks_hashed`` / ``bytes_hashed``); ``bytes_written`` stays the new rows' bytes.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ...codecs import edit_epoch
from ..context import StoreContext
from ..identity import namespace_key, tenant_of
from ..index import keys

CAPACITY = 64
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # memory bandwidth, not cores, is the limit past ~8


@dataclass(frozen=True)
class LayerMark:
    """One layer at capture: a weak reference to its cache (None if it takes none), its epoch (None without the
    protocol, or when it changed during the capture), its offset, and whether any of its slots has a token axis."""

    ref: weakref.ReferenceType | None
    epoch: int | None
    offset: int
    tokened: bool


def epoch_before(cache) -> int | None:
    return edit_epoch(cache)


def mark(cache, before: int | None, entry) -> LayerMark:
    """The layer's mark once its snapshot is evaluated: an epoch that moved during the capture is no epoch."""
    after = edit_epoch(cache)
    try:
        ref = weakref.ref(cache)
    except TypeError:
        ref = None
    epoch = before if before is not None and after == before else None
    return LayerMark(ref, epoch, entry.offset, any(s.token_axis is not None for s in entry.tensors))


@dataclass(frozen=True)
class Remembered:
    """The last save of one session through this handle."""

    snapshot_id: str
    chunk_tokens: int
    layers: tuple[LayerMark, ...]
    windows: dict[int, tuple[int, bytes, str]]  # start -> (stop, descriptor, hash)


class UnchangedBook:
    """The bounded LRU of ``Remembered`` saves of one handle (thread-safe: the background writer records too)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, str], Remembered] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Remembered | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: tuple[str, str], value: Remembered) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _same_object(a: LayerMark, b: LayerMark) -> bool:
    if a.ref is None or b.ref is None:
        return False
    obj = a.ref()
    return obj is not None and obj is b.ref()


def reuse_limit(prev: Remembered, marks: tuple[LayerMark, ...], chunk_tokens: int) -> int:
    """Positions below which every token window may reuse ``prev``'s hash (0: none may)."""
    if prev.chunk_tokens != chunk_tokens or len(prev.layers) != len(marks):
        return 0
    limit = None
    for old, new in zip(prev.layers, marks):
        if not (old.tokened or new.tokened):
            continue  # contributes to the untokened chunk only, which is always hashed
        if not (old.tokened and new.tokened) or new.epoch is None or old.epoch != new.epoch:
            return 0
        if not _same_object(old, new):
            return 0
        limit = old.offset if limit is None else min(limit, old.offset)
    return limit or 0


class ChunkHasher:
    """The hashes of one save's chunk plans: reused where ``Remembered`` proves a window unchanged, else computed
    (on ``threads`` threads, the windows the last save did not store first: ``hashed``)."""

    def __init__(self, book: UnchangedBook, ctx: StoreContext, cap, threads: int = HASH_THREADS):
        self.book, self.ctx, self.cap, self.threads = book, ctx, cap, threads
        self.key = (cap.namespace, cap.session_id)
        self.prev: Remembered | None = None
        self.limit = 0
        self.descriptors: dict[int, bytes] = {}
        # encryption at rest (objects/sealing.py): the tenant's key names and seals its chunks; ``contents`` maps
        # each keyed name computed here to the content hash its seal carries
        self.tkey = ctx.keys.for_tenant(tenant_of(cap.namespace)) if ctx.keys is not None else None
        self.contents: dict[str, str] = {}

    def bind(self, txn) -> None:
        """Take the remembered save if it is still the session's current snapshot (read in ``txn``)."""
        prev = self.book.get(self.key)
        self.prev, self.limit = None, 0
        if prev is None:
            return
        id_key = self.ctx.id_key
        skey = keys.session_key(id_key, namespace_key(id_key, self.cap.namespace), self.cap.session_id)
        current = txn.get("sessions", skey)
        if current is None or bytes(current) != bytes.fromhex(prev.snapshot_id):
            return
        self.prev, self.limit = prev, reuse_limit(prev, self.cap.marks, self.ctx.chunk_tokens)

    def _stored(self, plan, desc: bytes) -> tuple[int, bytes, str] | None:
        """The remembered save's entry for this exact window (same range, same descriptor), if it had one."""
        if self.prev is None or plan.stop == 0:
            return None
        old = self.prev.windows.get(plan.start)
        return old if old is not None and old[0] == plan.stop and old[1] == desc else None

    def hashed(self, plans):
        """``(index, hash)`` for every plan: first the windows the remembered save did not store (what will be
        written), then the ones it did. Hashes that must be computed are computed ahead on a thread pool, so the
        caller writes window k while k+1.. are hashed; counters are counted here, on the caller's thread."""
        descs = [plan.descriptor() for plan in plans]
        self.descriptors = dict(enumerate(descs))
        stored = [self._stored(plan, desc) for plan, desc in zip(plans, descs)]
        reused = [old is not None and plan.stop <= self.limit for plan, old in zip(plans, stored)]
        order = sorted(range(len(plans)), key=lambda i: stored[i] is not None)  # stable: new windows first
        todo = [i for i in order if not reused[i]]
        counters = self.ctx.counters
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvshelf-hash") \
            if self.threads > 1 and len(todo) > 1 else None
        try:
            futures = {i: pool.submit(plans[i].content_hash, descs[i]) for i in todo} if pool else {}
            for i in order:
                nbytes = plans[i].nbytes
                if reused[i]:
                    counters.chunks_hash_reused += 1
                    counters.bytes_hash_reused += nbytes
                    yield i, stored[i][2]
                    continue
                counters.chunks_hashed += 1
                counters.bytes_hashed += nbytes
                if stored[i] is not None:
                    counters.chunks_verified += 1
                    counters.bytes_verified += nbytes
                yield i, self._named(futures[i].result() if pool else plans[i].content_hash(descs[i]))
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def all(self, plans) -> list[str]:
        """Every plan's hash, in plan order."""
        out: list[str] = [""] * len(plans)
        for i, h in self.hashed(plans):
            out[i] = h
        return out

    def _named(self, h: str) -> str:
        """A chunk's name: its content hash, or on an encrypted store the tenant-keyed name of it."""
        if self.tkey is None:
            return h
        name = self.tkey.name(h)
        self.contents[name] = h
        return name

    def frame(self, name: str, plan, frame: list) -> list:
        """The chunk frame as written: sealed under the tenant's key on an encrypted store, else as it is."""
        if self.tkey is None:
            return frame
        content = self.contents.get(name) or plan.content_hash(plan.descriptor())  # a reused name
        return [self.tkey.seal(name, content, frame)]

    def remember(self, snapshot_id: str, plans, hashes: list[str]) -> None:
        """Record this committed save for the session's next one (descriptors interned: full windows share one)."""
        seen: dict[bytes, bytes] = {}
        windows = {}
        for i, (plan, h) in enumerate(zip(plans, hashes)):
            if plan.stop > 0:
                desc = self.descriptors.get(i) or plan.descriptor()
                windows[plan.start] = (plan.stop, seen.setdefault(desc, desc), h)
        self.book.put(self.key, Remembered(snapshot_id, self.ctx.chunk_tokens, tuple(self.cap.marks), windows))


__all__ = ["CAPACITY", "ChunkHasher", "HASH_THREADS", "LayerMark", "Remembered", "UnchangedBook", "epoch_before", "mark",
           "reuse_limit"]
