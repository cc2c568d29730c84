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
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from ...codecs import edit_epoch
from ..context import StoreContext
from ..identity import namespace_key, tenant_of
from ..index import keys
from ..objects.chunkfile import content_hash

CAPACITY = 64


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
    """The hashes of one save's chunk plans: reused where ``Remembered`` proves a window unchanged, else computed."""

    def __init__(self, book: UnchangedBook, ctx: StoreContext, cap):
        self.book, self.ctx, self.cap = book, ctx, cap
        self.key = (cap.namespace, cap.session_id)
        self.prev: Remembered | None = None
        self.limit = 0
        self.descriptors: list[bytes] = []
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

    def __call__(self, plan) -> str:
        desc = plan.descriptor()
        self.descriptors.append(desc)
        nbytes = plan.nbytes
        counters = self.ctx.counters
        if 0 < plan.stop <= self.limit:
            old = self.prev.windows.get(plan.start)
            if old is not None and old[0] == plan.stop and old[1] == desc:
                counters.chunks_hash_reused += 1
                counters.bytes_hash_reused += nbytes
                return old[2]
        counters.chunks_hashed += 1
        counters.bytes_hashed += nbytes
        h = content_hash(plan.pieces, desc)
        if self.tkey is None:
            return h
        name = self.tkey.name(h)
        self.contents[name] = h
        return name

    def frame(self, name: str, plan, frame: list) -> list:
        """The chunk frame as written: sealed under the tenant's key on an encrypted store, else as it is."""
        if self.tkey is None:
            return frame
        content = self.contents.get(name) or content_hash(plan.pieces, plan.descriptor())  # a reused name
        return [self.tkey.seal(name, content, frame)]

    def remember(self, snapshot_id: str, plans, hashes: list[str]) -> None:
        """Record this committed save for the session's next one (descriptors interned: full windows share one)."""
        seen: dict[bytes, bytes] = {}
        windows = {}
        for plan, desc, h in zip(plans, self.descriptors, hashes):
            if plan.stop > 0:
                windows[plan.start] = (plan.stop, seen.setdefault(desc, desc), h)
        self.book.put(self.key, Remembered(snapshot_id, self.ctx.chunk_tokens, tuple(self.cap.marks), windows))


__all__ = ["CAPACITY", "ChunkHasher", "LayerMark", "Remembered", "UnchangedBook", "epoch_before", "mark",
           "reuse_limit"]
