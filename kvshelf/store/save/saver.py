"""The save path: capture live caches, cut them into chunks, write the new ones as ONE pack, index it in ONE commit.

Why this shape (layout v2): a durable save costs one data pass (``pwritev`` straight from the evaluated MLX arrays'
head runs — a ``[1, H, t, D]`` window of a ``[1, H, T, D]`` plane is H runs, never joined), one fsync and one
directory fsync (the byte store's ``put``), and one LMDB commit. The pack's trailer carries the manifest, so there is
no manifest file to sync. Chunks are content-addressed (xxh3-128 over the logical content, hashed from the same
buffers that are written) and deduplicated against every indexed chunk, v1 chunk files included — except a chunk marked
bad (``index/bad_chunks.py``): its fresh copy is written and takes the name back in the commit.

A save cuts its chunks where the stored snapshot it extends cut them (``alignment.py``, ``chunking.cuts``), so a
session re-saved every few tokens writes its new rows only, never the window straddling its old end again.

A grown session's save skips the *write* of the chunks already stored and, for kvshelf's own caches, their
*hashing* too: the handle remembers each session's last save, and a token window the cache's edit epoch proves
unchanged since then reuses its old hash (``hash_reuse.py`` says exactly when). Everything else — mlx-lm's caches,
a cache trimmed, rolled back or replaced since, a short tail rewritten with what follows it, the untokened chunk — is
hashed, from the very buffers that are written, on a pool of threads and new windows first, so verifying what
mlx-lm's caches stored last time overlaps writing what they added.
"""

from __future__ import annotations

from functools import partial

import time
import uuid
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...errors import InvalidCacheState, KvShelfError, SnapshotNotFound, StoreFull
from ..context import StoreContext
from ..index import bad_chunks
from ..liveness import ledger
from ..index import schema
from . import alignment, hash_reuse
from ..objects.chunkfile import raw_buffers
from .checkpoints import Checkpoints
from .chunking import ChunkPlan, plan_chunks
from ..index.schema import ChunkRef, Manifest
from ..liveness.reclaim import Reclaimer
from ..liveness.save_gate import SaveGate
from ..liveness.transactions import Transactions
from ..objects.pack import PACK_MAGIC, PackBuilder, new_pack_name
from ..objects.protocol import capability
from ..prefix.hashing import tokens_array
from ..results import SnapshotInfo
from ..space.budget import Budget


@dataclass
class Capture:
    """A snapshot taken from live caches: evaluated arrays plus everything the writer needs."""

    session_id: str
    namespace: str
    tokens: np.ndarray
    entries: list
    arrays: list[list[mx.array]]
    nbytes: int
    marks: tuple = ()  # hash_reuse.LayerMark per layer: which hashes the next write may reuse


def capture(provider, session_id: str, tokens, caches, namespace: str) -> Capture:
    """Snapshot and evaluate the caches now (what a save, or a queued ``save_async``, writes later). The façade
    checked the session id (a checkpoint's derived id is the store's own: ``checkpoints.py``)."""
    toks = tokens_array(tokens)
    if isinstance(caches, (str, bytes)) or not hasattr(caches, "__len__") or not caches:
        raise InvalidCacheState("caches must be a non-empty sequence of caches (one per layer)")
    entries, arrays, before = [], [], []
    for i, cache in enumerate(caches):
        before.append(hash_reuse.epoch_before(cache))
        entry, arrs = provider.snapshot(cache, checksums=False, length=len(toks))  # chunks are hashed
        if entry.offset != len(toks):
            raise InvalidCacheState(f"cache {i} holds {entry.offset} positions but {len(toks)} tokens were given")
        entries.append(entry)
        arrays.append(list(arrs))
    mx.eval([a for row in arrays for a in row])
    nbytes = sum(a.nbytes for row in arrays for a in row)
    marks = tuple(hash_reuse.mark(c, b, e) for c, b, e in zip(caches, before, entries))
    return Capture(session_id, namespace, toks, entries, arrays, nbytes, marks)


def reusable(txn, hash_: str) -> bool:
    """Whether a save may dedupe onto the indexed copy of a chunk: it is indexed and not marked bad (a copy that
    failed its hash is never reused; the save writes fresh bytes and its commit takes the name back)."""
    return txn.get("chunks", bytes.fromhex(hash_)) is not None and not bad_chunks.is_bad(txn, hash_)


def chunk_metadata(ref: ChunkRef) -> dict[str, str]:
    """The safetensors metadata every chunk frame carries (format tag, content hash, token range)."""
    return {"format": "kvshelf-chunk-v1", "kvshelf.hash": ref.hash, "kvshelf.tokens": f"{ref.start}:{ref.stop}"}


def _manifest(ctx: StoreContext, cap: Capture, sid: str, plans: list[ChunkPlan], hashes: list[str]) -> Manifest:
    chunks, own = [], []
    for plan, h in zip(plans, hashes):
        ref = ChunkRef(h, plan.start, plan.stop, plan.nbytes)
        (own if plan.stop == 0 else chunks).append(ref)
    ident = ctx.identity
    return Manifest(
        snapshot_id=sid, session_id=cap.session_id, namespace=cap.namespace, model_id=ident.model_id,
        config_fingerprint=ident.config_fingerprint, tokenizer_hash=ident.tokenizer_hash,
        provider=ctx.provider.id, tokens=cap.tokens.tolist(), entries=cap.entries, chunk_tokens=ctx.chunk_tokens,
        chunks=chunks, own=own, created_at=time.time(),
        minimum_reusable_offset=max((e.minimum_reusable_offset for e in cap.entries), default=0),
        trimmable=all(ctx.provider.for_entry(e).header_trimmable(e) for e in cap.entries))


def _stream_pack(ctx: StoreContext, cap: Capture, plans: list[ChunkPlan], sid: str, hashes: list[str],
                 hasher: hash_reuse.ChunkHasher):
    """The save's pack written while its chunks are hashed: chunks k+1.. are hashed on the hasher's threads (and
    checked against the index) while chunk k is being written (``put_stream``); the windows the session's last save
    did not store are hashed and written first, the stored ones verified behind them. Returns (manifest, pack, size,
    placed)."""
    builder = PackBuilder()
    done: dict[str, Manifest] = {}

    def parts():
        yield [PACK_MAGIC]
        seen: set[str] = set()
        got: list[str] = [""] * len(plans)
        with ctx.index.read() as txn:
            hasher.bind(txn)
            for i, h in hasher.hashed(plans):  # the windows not stored last time come first: they are written
                got[i] = h
                if h in seen or reusable(txn, h):
                    seen.add(h)
                    continue
                seen.add(h)
                plan = plans[i]
                ref = ChunkRef(h, plan.start, plan.stop, plan.nbytes)
                frame = hasher.frame(h, plan, raw_buffers(plan.pieces, chunk_metadata(ref)))
                builder.add(h, frame, keep=False)
                yield frame
        hashes.extend(got)
        done["m"] = _manifest(ctx, cap, sid, plans, hashes)
        yield builder.trailer(schema.encode(done["m"]))

    name = new_pack_name(sid)
    size = ctx.bytes.put_stream(name, parts())
    return done["m"], name, size, {h: (name, off, n, enc, size) for h, (off, n, enc) in builder.where.items()}


def _commit(ctx: StoreContext, txn, manifest: Manifest, pack: str, pack_size: int, placed: ledger.Placed):
    """The save's one write transaction; a checkpoint whose session went while it was written is refused in it."""
    if Checkpoints.owner_gone(txn, manifest):
        raise SnapshotNotFound(f"session of checkpoint {manifest.session_id!r} was removed while the checkpoint was "
                               f"saved; nothing was kept")
    return ledger.commit(ctx.index, txn, manifest, pack, pack_size, placed)


class Saver:
    """One handle's saves: hashing (with the handle's ``UnchangedBook``), one pack, one commit, then the budget."""

    def __init__(self, ctx: StoreContext, gate: SaveGate, txns: Transactions, reclaimer: Reclaimer, budget: Budget):
        self.ctx, self.gate, self.txns, self.reclaimer, self.budget = ctx, gate, txns, reclaimer, budget
        self.book = hash_reuse.UnchangedBook()  # each session's last save here: hashes a grown save may reuse

    def capture(self, session_id: str, tokens, caches, namespace: str) -> Capture:
        return capture(self.ctx.provider, session_id, tokens, caches, namespace)

    def write(self, cap: Capture) -> SnapshotInfo:
        ctx = self.ctx
        t0 = time.perf_counter()
        stored = alignment.stored_windows(ctx, self.book, (cap.namespace, cap.session_id), cap.tokens)
        plans = plan_chunks(cap.entries, cap.arrays, ctx.chunk_tokens, stored)
        sid = uuid.uuid4().hex
        stream = ctx.max_bytes is None and capability(ctx.bytes, "supports_streaming")
        hashes: list[str] = []
        hasher = hash_reuse.ChunkHasher(self.book, ctx, cap)
        if not stream:  # hash first: a budget must refuse a snapshot before anything is written
            with ctx.index.read() as txn:
                hasher.bind(txn)
            hashes = hasher.all(plans)
            manifest = _manifest(ctx, cap, sid, plans, hashes)
            need = sum(r.nbytes for r in {r.hash: r for r in manifest.all_chunks}.values())
            if ctx.max_bytes is not None and need > ctx.max_bytes:
                raise StoreFull(f"snapshot of session {cap.session_id!r} needs {need} bytes, more than the store "
                                f"budget max_bytes={ctx.max_bytes}; nothing was written")
        written = n_written = 0
        packs: list[str] = []
        committed = False
        with self.gate.hold():
            try:
                placed: ledger.Placed = {}
                pack = None
                if stream:
                    manifest, pack, pack_size, placed = _stream_pack(ctx, cap, plans, sid, hashes, hasher)
                    packs.append(pack)
                    todo = []
                else:
                    with ctx.index.read() as txn:
                        todo = [r for r in {r.hash: r for r in manifest.all_chunks}.values()
                                if not reusable(txn, r.hash)]
                by_hash = dict(zip(hashes, plans))
                unique = {r.hash: r for r in manifest.all_chunks}
                written = sum(unique[h].nbytes for h in placed)
                n_written = len(placed)
                for _attempt in range(5):  # the first pack carries the manifest; a retry's only what it re-writes
                    if pack is None or todo:
                        name, size, more = self.write_pack([(r, by_hash[r.hash].pieces) for r in todo],
                                                          schema.encode(manifest) if pack is None else b"",
                                                          name=new_pack_name(sid if pack is None else ""),
                                                          seal={r.hash: partial(hasher.frame, r.hash, by_hash[r.hash])
                                                                for r in todo})
                        packs.append(name)
                        if pack is None:
                            pack, pack_size = name, size
                        placed.update(more)
                        written += sum(unique[h].nbytes for h in more)
                        n_written += len(more)
                    try:
                        old, freed = self.txns.write(lambda txn: _commit(ctx, txn, manifest, pack, pack_size, placed))
                        committed = True
                        break
                    except ledger.MissingChunks as missing:  # dropped by a concurrent eviction since we checked
                        todo = [unique[h] for h in missing.hashes]
                else:  # pragma: no cover - needs five lost races in a row
                    raise KvShelfError(f"could not commit snapshot of session {cap.session_id!r}: chunks kept "
                                      f"vanishing")
            finally:
                if not committed:  # a failed save leaves nothing behind (what it wrote is unreferenced)
                    self.reclaimer.reclaim(packs)
            # still inside the gate (verify's residue check takes it exclusively): a retry's pack is dead if a
            # concurrent save indexed its chunks first; ``freed`` is what the replaced snapshot alone used
            self.reclaimer.reclaim(packs[1:] + freed)
        hasher.remember(sid, plans, hashes)
        need = sum(r.nbytes for r in unique.values())
        reused = need - written
        ctx.counters.chunks_written += n_written
        ctx.counters.bytes_written += written
        ctx.counters.bytes_reused += reused
        self.budget.evict(protect=bytes.fromhex(sid))
        return SnapshotInfo(sid, cap.session_id, len(cap.tokens), written, reused, manifest.minimum_reusable_offset,
                            cap.namespace, n_written, len(unique) - n_written, time.perf_counter() - t0)

    def write_pack(self, items: list, manifest: bytes = b"", name: str | None = None,
                   seal: dict | None = None) -> tuple[str, int, ledger.Placed]:
        """One pack holding the chunks ``[(ref, pieces)]`` back to back and ``manifest`` in its trailer; durable when
        this returns (one fsync + one directory fsync). Returns (name, size, where each chunk lies). ``seal``: per
        chunk name, what turns its frame into the bytes written (encryption at rest: ``objects/sealing.py``)."""
        builder = PackBuilder()
        for ref, pieces in items:
            frame = raw_buffers(pieces, chunk_metadata(ref))
            builder.add(ref.hash, seal[ref.hash](frame) if seal and ref.hash in seal else frame)
        name = name or new_pack_name()
        size = self.ctx.bytes.put(name, builder.finish(manifest))
        placed = {h: (name, off, n, enc, size) for h, (off, n, enc) in builder.where.items()}
        return name, size, placed


__all__ = ["Capture", "Saver", "capture", "chunk_metadata"]
