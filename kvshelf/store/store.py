"""The session store: saves, restores and prefix reuse over an LMDB index and content-addressed chunk blobs.

Commit order (durability): every blob of a snapshot is written, fsynced and renamed first, then its manifest file,
then ONE LMDB write transaction adds manifest, summary, tokens, prefix records, session pointer and chunk refcounts.
Blobs whose last reference was dropped are unlinked only in a *later* write transaction that re-checks the refcount
and the live leases while holding LMDB's writer lock, so a concurrent saver can never commit a reference to a blob
that is being unlinked. A crash therefore leaves at most orphan blobs, manifest files and tmp files (``gc``).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lmdb
import mlx.core as mx
import msgspec
import numpy as np

from ..codecs import CacheEntry, CodecProvider, default_provider
from ..errors import (CorruptData, IdentityMismatch, InvalidCacheState, KvShelfError, SnapshotNotFound,
                      StoreFull, WrongArgumentType)
from . import inputs
from . import manifest as mf
from . import openlock
from .blobfile import BlobReader, Piece, content_hash
from .blobs import LocalBlobStore, ensure_dir, pid_alive
from .identity import Identity, namespace_key
from .index import Index
from .layout import BatchDestinations, BlobPlan, Destinations, fill_from_blob, plan_blobs
from .manifest import BlobRef, ChunkMeta, Lease, Manifest, Summary
from .openlock import StoreBusy
from .lookup import LazyTokens, _Lookup
from .prefix import BLOCK_TOKENS, all_boundaries, tokens_array
from .results import PrefixHit, Restored, RestoredBatch, SessionInfo, SnapshotInfo
from .writer import BackgroundWriter

class _MissingBlobs(Exception):
    def __init__(self, hashes: list[str]):
        self.hashes = hashes


class _Gone(Exception):
    pass


class _Stale(SnapshotNotFound):
    """The manifest in hand names blobs the snapshot no longer references (it was rewritten in place)."""


@dataclass
class _Read:
    """One snapshot being read: its (cut) entries, the blobs covering the cut, and the lease held on them."""

    manifest: Manifest
    entries: list[CacheEntry]
    needed: list[BlobRef]
    lease: bytes | None
    ok: bool = False


@dataclass
class _Capture:
    """A snapshot taken from live caches: evaluated arrays plus everything the writer needs."""

    session_id: str
    namespace: str
    tokens: np.ndarray
    entries: list[CacheEntry]
    arrays: list[list[mx.array]]
    nbytes: int


def _now_ns() -> int:
    return time.time_ns()


def _be64(n: int) -> bytes:
    return struct.pack(">Q", n)


class Store:
    """One store directory opened under one ``Identity``. Thread-safe; several processes may open it at once.

    ``admin=True`` (with no identity) opens it identity-blind for offline tools: the tools surface below works on
    every identity's snapshots, while the identity-scoped calls (save, restore, lookup, sessions, delete) refuse.
    """

    def __init__(self, path: str | os.PathLike, identity: Identity | None, *, max_bytes: int | None = None,
                 chunk_tokens: int = 256, verify: bool = True, provider: CodecProvider | None = None,
                 map_size: int = 64 << 30, max_pending_bytes: int = 2 << 30, lease_seconds: float = 600.0,
                 admin: bool = False):
        if admin and identity is not None:
            raise InvalidCacheState("an admin handle is identity-blind: pass identity=None with admin=True")
        if not admin and not isinstance(identity, Identity):
            raise WrongArgumentType(f"identity must be a kvshelf Identity, got {type(identity).__name__}")
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise InvalidCacheState(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise InvalidCacheState(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")
        self.root = os.path.abspath(os.fspath(path))
        ensure_dir(self.root)
        os.chmod(self.root, 0o700)
        self.identity, self.max_bytes, self.chunk_tokens = identity, max_bytes, chunk_tokens
        self.verify_reads, self.provider, self.lease_seconds = verify, provider or default_provider, lease_seconds
        self.admin = admin
        self.id_key = identity.key if identity is not None else None
        self.blobs = LocalBlobStore(self.root)
        lock_dir = os.path.join(self.root, "locks")
        ensure_dir(lock_dir)
        self._gate_path = os.path.join(lock_dir, "save.lock")
        os.close(os.open(self._gate_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self._lock_key = os.path.realpath(self.root)
        openlock.acquire(self._lock_key)  # before LMDB maps the index: "open" is exact (openlock.py)
        try:
            self.blobs.reap_tmp()
            self.index = Index(os.path.join(self.root, "index"), map_size=map_size)
        except BaseException:
            openlock.release(self._lock_key)
            raise
        self.block = BLOCK_TOKENS
        self._lease_counter = 0
        self._lock = threading.RLock()
        self._deferred: list[tuple[bytes, bytes | None, list[str], int]] = []
        self._touched: dict[bytes, int] = {}  # last uses not yet written (deferred), seen by this handle's lookups
        self._deferred_timer: threading.Timer | None = None
        self._writer = BackgroundWriter(max_pending_bytes)
        self.counters = {"blobs_read": 0, "bytes_read": 0, "blobs_written": 0, "bytes_written": 0,
                         "bytes_reused": 0, "lookups": 0, "hits": 0, "quarantined": 0, "evicted": 0,
                         "batch_layers_direct": 0, "batch_layers_fallback": 0}
        self._closed = self._closing = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for queued async saves (errors are not raised here: call ``flush`` first), then close the index."""
        if self._closed:
            return
        self._writer.close()
        with self._lock:
            self._closing = True
            timer, self._deferred_timer = self._deferred_timer, None
        if timer is not None:
            timer.cancel()
            timer.join()
        try:
            if self._deferred:
                self._txn(lambda txn: None)
        finally:
            self._closed = True
            self.index.close()
            openlock.release(self._lock_key)

    def _check_open(self) -> None:
        if self._closed:
            raise KvShelfError(f"store {self.root} is closed")

    def _check_scoped(self, what: str) -> None:
        self._check_open()
        if self.id_key is None:
            raise KvShelfError(f"{what} needs a model identity: this handle on {self.root} was opened identity-blind "
                               f"(admin=True) for offline tools")

    @contextmanager
    def save_gate(self, exclusive: bool = False, timeout: float = 30.0) -> Iterator[None]:
        """The store-wide save gate (``locks/save.lock``, flock): saves hold it shared from their first blob write to
        their commit; orphan sweeps and offline jobs hold it exclusively, so an in-flight save's blobs are never
        taken for crash residue. Tools writing blobs of their own hold it shared the same way. ``TimeoutError`` when
        it cannot be had within ``timeout`` seconds."""
        fd = os.open(self._gate_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError("save lock busy") from None
                    time.sleep(0.005)
            yield
        finally:
            os.close(fd)  # closing the description releases the lock

    def _ns_key(self, namespace: str) -> bytes:
        self._check_scoped("a namespaced call")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        return namespace_key(self.id_key, namespace)

    def _session_key(self, session_id: str, namespace: str) -> bytes:
        if not isinstance(session_id, str) or not session_id or len(session_id) > 1024:
            raise ValueError(f"session_id must be a non-empty str of at most 1024 characters, got {session_id!r}")
        return self.id_key + self._ns_key(namespace) + session_id.encode("utf-8", "surrogatepass")

    # ------------------------------------------------------------------ saving
    def save(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "") -> SnapshotInfo:
        """Persist the caches for ``tokens`` as the session's latest snapshot (only new chunks are written)."""
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self._check_scoped("save")
        return self._write(self._capture(session_id, tokens, caches, namespace))

    def save_async(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any],
                   namespace: str = "") -> Future:
        """Snapshot and evaluate now, write in the background; ``flush()`` waits and re-raises failures."""
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self._check_scoped("save_async")
        capture = self._capture(session_id, tokens, caches, namespace)
        return self._writer.submit(lambda: self._write(capture), capture.nbytes)

    def flush(self) -> None:
        self._writer.flush()

    def _capture(self, session_id: str, tokens, caches, namespace: str) -> _Capture:
        self._session_key(session_id, namespace)
        toks = tokens_array(tokens)
        if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence) or not caches:
            raise InvalidCacheState("caches must be a non-empty sequence of caches (one per layer)")
        entries, arrays = [], []
        for i, cache in enumerate(caches):
            entry, arrs = self.provider.for_cache(cache).snapshot(cache, checksums=False)  # chunks are hashed
            if entry.offset != len(toks):
                raise InvalidCacheState(f"cache {i} holds {entry.offset} positions but {len(toks)} tokens were given")
            entries.append(entry)
            arrays.append(list(arrs))
        mx.eval([a for row in arrays for a in row])
        nbytes = sum(a.nbytes for row in arrays for a in row)
        return _Capture(session_id, namespace, toks, entries, arrays, nbytes)

    def _write(self, cap: _Capture) -> SnapshotInfo:
        t0 = time.perf_counter()
        plans = plan_blobs(cap.entries, cap.arrays, self.chunk_tokens)
        by_hash: dict[str, BlobPlan] = {}
        chunks, own = [], []
        for plan in plans:
            h = content_hash(plan.pieces)
            by_hash[h] = plan
            ref = BlobRef(h, plan.start, plan.stop, sum(p.data.nbytes for p in plan.pieces))
            (own if plan.stop == 0 else chunks).append(ref)
        sid = uuid.uuid4().hex
        manifest = Manifest(
            snapshot_id=sid, session_id=cap.session_id, namespace=cap.namespace,
            model_id=self.identity.model_id, config_fingerprint=self.identity.config_fingerprint,
            tokenizer_hash=self.identity.tokenizer_hash, provider=self.provider.id, tokens=cap.tokens.tolist(),
            entries=cap.entries, chunk_tokens=self.chunk_tokens, chunks=chunks, own=own, created_at=time.time(),
            minimum_reusable_offset=max((e.minimum_reusable_offset for e in cap.entries), default=0),
            trimmable=all(self.provider.for_entry(e).header_trimmable(e) for e in cap.entries))
        unique = {r.hash: r for r in manifest.blobs}
        if self.max_bytes is not None and sum(r.nbytes for r in unique.values()) > self.max_bytes:
            raise StoreFull(f"snapshot of session {cap.session_id!r} needs {sum(r.nbytes for r in unique.values())} "
                            f"bytes, more than the store budget max_bytes={self.max_bytes}; nothing was written")
        written = reused = n_written = 0
        fresh: list[str] = []
        committed = False
        with self.save_gate():
            try:
                todo = list(unique.values())
                for attempt in range(5):
                    new = [ref for ref in todo if self.blobs.has(ref.hash) is None]
                    reused += sum(ref.nbytes for ref in todo) - sum(ref.nbytes for ref in new)
                    self.blobs.put_many([(r.hash, by_hash[r.hash].pieces, self.blob_metadata(r)) for r in new])
                    fresh.extend(r.hash for r in new)
                    written += sum(r.nbytes for r in new)
                    n_written += len(new)
                    if attempt == 0:
                        self.blobs.put_manifest(sid, mf.encode(manifest))
                    try:
                        old, freed = self._txn(lambda txn: self._commit(txn, manifest, replaces=None))
                        committed = True
                        break
                    except _MissingBlobs as missing:  # unlinked by a concurrent eviction between check and commit
                        todo = [unique[h] for h in missing.hashes]
                        reused -= sum(unique[h].nbytes for h in missing.hashes)
                else:  # pragma: no cover - needs five lost races in a row
                    raise KvShelfError(f"could not commit snapshot of session {cap.session_id!r}: blobs kept vanishing")
            finally:
                if not committed:  # a failed save leaves nothing behind (what it wrote is still unreferenced)
                    self.blobs.delete_manifest(sid)
                    self._reclaim(fresh)
        self._after_drop(old, freed)
        self.counters["blobs_written"] += n_written
        self.counters["bytes_written"] += written
        self.counters["bytes_reused"] += reused
        self._evict_to_budget(protect=bytes.fromhex(sid))
        return SnapshotInfo(sid, cap.session_id, len(cap.tokens), written, reused, manifest.minimum_reusable_offset,
                            cap.namespace, n_written, len(unique) - n_written, time.perf_counter() - t0)

    @staticmethod
    def blob_metadata(ref: BlobRef) -> dict[str, str]:
        """The safetensors metadata every chunk blob carries (format tag, content hash, token range)."""
        return {"format": "kvshelf-chunk-v1", "kvshelf.hash": ref.hash, "kvshelf.tokens": f"{ref.start}:{ref.stop}"}

    def _commit(self, txn: lmdb.Transaction, manifest: Manifest, replaces: bytes | None):
        """Index one snapshot (replacing the session's previous one). Returns (dropped sid, freed hashes)."""
        db = self.index.db
        now = _now_ns()
        unique = {r.hash: r for r in manifest.blobs}
        missing = [h for h in unique
                   if txn.get(bytes.fromhex(h), db=db["chunks"]) is None and self.blobs.stat(h) is None]
        if missing:
            raise _MissingBlobs(missing)
        idk = identity_key_of(manifest)
        nsk = namespace_key(idk, manifest.namespace)
        skey = idk + nsk + manifest.session_id.encode("utf-8", "surrogatepass")
        freed: list[str] = []
        old = replaces if replaces is not None else txn.get(skey, db=db["sessions"])
        if old is not None:
            freed = self._drop(txn, old)
        sid = bytes.fromhex(manifest.snapshot_id)
        total = self.index.meta_int(txn, b"total_bytes")
        for h, ref in unique.items():
            raw = txn.get(bytes.fromhex(h), db=db["chunks"])  # read after _drop above: it may have removed it
            if raw is None:  # a new blob, or one whose last reference the replaced snapshot held
                st = self.blobs.stat(h)
                meta = ChunkMeta(0, ref.nbytes, st.stored_bytes, st.encoding, now)
                total += st.stored_bytes
            else:
                meta = mf.decode(raw, ChunkMeta, f"chunk record {h}")
            if h in freed:
                freed.remove(h)
            txn.put(bytes.fromhex(h), mf.encode(ChunkMeta(meta.refs + 1, meta.nbytes, meta.stored_bytes,
                                                          meta.encoding, now)), db=db["chunks"])
        self.index.set_meta_int(txn, b"total_bytes", total)
        summary = Summary(idk, nsk, manifest.session_id, manifest.namespace, manifest.length,
                          manifest.minimum_reusable_offset, manifest.trimmable, manifest.nbytes,
                          manifest.created_at, now)
        txn.put(sid, mf.encode(manifest), db=db["manifests"])
        txn.put(sid, mf.encode(summary), db=db["summaries"])
        tokens = np.asarray(manifest.tokens, dtype="<i8")
        txn.put(sid, tokens.tobytes(), db=db["tokens"])
        for key, cont in all_boundaries(nsk, tokens, self.block):
            txn.put(key, cont + sid, db=db["prefix"], dupdata=True)
        txn.put(skey, sid, db=db["sessions"])
        txn.put(idk + _be64(now) + sid, b"", db=db["lru"])
        txn.delete(skey, db=db["quarantine"])
        return old, freed

    def _drop(self, txn: lmdb.Transaction, sid: bytes) -> list[str]:
        """Remove a snapshot from the index; returns the blob hashes whose last reference it held."""
        db = self.index.db
        raw = txn.get(sid, db=db["manifests"])
        if raw is None:
            return []
        manifest = mf.decode(raw, Manifest, f"manifest {sid.hex()}")
        summary = mf.decode(txn.get(sid, db=db["summaries"]), Summary, f"summary {sid.hex()}")
        for name in ("manifests", "summaries", "tokens"):
            txn.delete(sid, db=db[name])
        for key, cont in all_boundaries(summary.ns_key, np.asarray(manifest.tokens, dtype="<i8"), self.block):
            txn.delete(key, cont + sid, db=db["prefix"])
        skey = summary.id_key + summary.ns_key + summary.session_id.encode("utf-8", "surrogatepass")
        if txn.get(skey, db=db["sessions"]) == sid:
            txn.delete(skey, db=db["sessions"])
        txn.delete(summary.id_key + _be64(summary.last_used_ns) + sid, db=db["lru"])
        freed = []
        total = self.index.meta_int(txn, b"total_bytes")
        for h in {r.hash for r in manifest.blobs}:
            key = bytes.fromhex(h)
            raw = txn.get(key, db=db["chunks"])
            if raw is None:
                continue
            meta = mf.decode(raw, ChunkMeta, f"chunk record {h}")
            if meta.refs <= 1:
                txn.delete(key, db=db["chunks"])
                total -= meta.stored_bytes
                freed.append(h)
            else:
                txn.put(key, mf.encode(ChunkMeta(meta.refs - 1, meta.nbytes, meta.stored_bytes, meta.encoding,
                                                 meta.last_used_ns)), db=db["chunks"])
        self.index.set_meta_int(txn, b"total_bytes", total)
        return freed

    def _after_drop(self, dropped: bytes | None, freed: list[str], quarantine: bool = False) -> None:
        if dropped is not None:
            self.blobs.delete_manifest(dropped.hex(), quarantine=quarantine)
        self._reclaim(freed)

    def _reclaim(self, hashes: list[str]) -> None:
        """Unlink blobs that are still unreferenced and unleased, holding the LMDB writer lock while doing so."""
        if hashes:
            self._txn(lambda txn: None, unlink=hashes)

    def _live_leases(self, txn) -> tuple[set[str], set[str]]:
        """(snapshot ids, blob hashes) held by live leases (pid alive, not expired)."""
        sids, hashes = set(), set()
        now = time.time()
        with self._lock:
            released = {item[0] for item in self._deferred}
        for key, raw in txn.cursor(db=self.index.db["leases"]):
            if bytes(key) in released:  # released by this handle, deletion deferred to its next write
                continue
            lease = mf.decode(raw, Lease, "lease")
            if lease.expires > now and pid_alive(lease.pid):
                sids.add(lease.snapshot_id)
                hashes.update(lease.hashes)
        return sids, hashes

    # ------------------------------------------------------------------ budget
    def _evict_to_budget(self, protect: bytes | None = None) -> int:
        """Evict this identity's least-recently-used unleased snapshots until the store fits ``max_bytes``."""
        if self.max_bytes is None:
            return 0
        evicted = 0
        while True:
            def pick(txn):
                if self.index.meta_int(txn, b"total_bytes") <= self.max_bytes:
                    return None
                leased = self._live_leases(txn)[0]
                cur = txn.cursor(db=self.index.db["lru"])
                if not cur.set_range(self.id_key):
                    return None
                for key in cur.iternext(keys=True, values=False):
                    if not key.startswith(self.id_key):
                        break
                    sid = key[24:40]
                    if sid == protect or sid.hex() in leased:
                        continue
                    return sid, self._drop(txn, sid)
                return None

            victim = self._txn(pick)
            if victim is None:
                return evicted
            self._after_drop(*victim)
            evicted += 1
            self.counters["evicted"] += 1

    # ------------------------------------------------------------------ lookup
    def lookup(self, prompt_tokens: Sequence[int], namespace: str = "") -> PrefixHit | None:
        """The longest usable stored prefix of the prompt (API.md rule), or None. Reads no blobs.

        A list prompt is converted (and checked) only as far as the lookup reads it, so a miss costs microseconds
        however long the prompt; arrays are converted whole (that is cheap)."""
        prompt_tokens, _ = inputs.check_prompt(prompt_tokens), inputs.check_namespace(namespace)
        self._check_scoped("lookup")
        prompt = LazyTokens(prompt_tokens, "prompt_tokens")
        nsk = self._ns_key(namespace)
        self.counters["lookups"] += 1
        with self.index.read() as txn:
            best = _Lookup(self, txn, nsk, prompt).run()
        if best is None:
            return None
        self.counters["hits"] += 1
        p, summary, sid, _rank = best
        return PrefixHit(summary.session_id, sid.hex(), p, summary.namespace, summary.length)

    # ------------------------------------------------------------------ restoring
    def restore(self, session_id: str, namespace: str = "") -> Restored:
        """The session's latest snapshot, whole."""
        inputs.check_session(session_id, namespace)
        self._check_scoped("restore")
        for attempt in range(3):
            with self.index.read() as txn:
                manifest = self._latest(txn, session_id, namespace)
            try:
                return self._restore(manifest, manifest.length)
            except SnapshotNotFound:  # replaced by a newer save between reading the pointer and leasing: again
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def restore_snapshot(self, snapshot_id: str, length: int | None = None) -> Restored:
        """A snapshot by id (cut to ``length`` if given); another identity's snapshot raises ``IdentityMismatch``."""
        snapshot_id, length = inputs.check_snapshot_id(snapshot_id), inputs.check_length(length)
        self._check_scoped("restore_snapshot")
        manifest = self.manifest(snapshot_id)
        self._check_identity(manifest)
        p = manifest.length if length is None else int(length)
        self._check_cut(manifest, p)
        return self._restore(manifest, p)

    def restore_prefix(self, prompt_tokens: Sequence[int], namespace: str = "") -> Restored | None:
        """Caches for the longest usable stored prefix of the prompt (reading only the chunks covering it)."""
        prompt_tokens, _ = inputs.check_prompt(prompt_tokens), inputs.check_namespace(namespace)
        for _ in range(3):
            hit = self.lookup(prompt_tokens, namespace)
            if hit is None:
                return None
            try:
                return self.restore_snapshot(hit.snapshot_id, hit.length)
            except SnapshotNotFound:  # evicted or replaced between lookup and restore: look again
                continue
        return None

    def restore_batch(self, requests: Sequence[str | PrefixHit | tuple[str, str]], _attempt: int = 0) -> RestoredBatch:
        """Several rows restored straight into one batched cache per layer, rows in request order."""
        inputs.check_requests(requests)
        self._check_scoped("restore_batch")
        if not requests:
            raise InvalidCacheState("restore_batch needs at least one request")
        plans = []
        with self.index.read() as txn:
            for req in requests:
                if isinstance(req, PrefixHit):
                    manifest = self._manifest(txn, bytes.fromhex(req.snapshot_id))
                    self._check_identity(manifest)
                    plans.append((manifest, req.length))
                    continue
                session_id, namespace = (req if isinstance(req, tuple) else (req, ""))
                manifest = self._latest(txn, session_id, namespace)
                plans.append((manifest, manifest.length))
        for manifest, p in plans:
            self._check_cut(manifest, p)
        reads: list[_Read] = []
        try:
            try:
                for manifest, p in plans:
                    reads.append(self._open_read(manifest, p))
            except SnapshotNotFound:
                # a session was saved again (or deleted) meanwhile: plan again from the current pointers, a few times
                if _attempt >= 2 or all(isinstance(r, PrefixHit) for r in requests):
                    raise
                for read in reads:
                    self._close_read(read)
                return self.restore_batch(requests, _attempt=_attempt + 1)
            caches = self._read_batch(reads)
            for read in reads:
                read.ok = True
        finally:
            for read in reads:
                self._close_read(read)
        return RestoredBatch(caches, [p for _, p in plans], [list(m.tokens[:p]) for m, p in plans])

    def _read_batch(self, reads: list[_Read]) -> list[Any]:
        """Every row read straight into one destination per batched tensor of each layer whose codec gives a
        ``batch_plan``, then wrapped by ``adopt_batch``; other layers go through per-row arrays and ``load_batch``."""
        n_layers = len(reads[0].entries)
        if any(len(r.entries) != n_layers for r in reads):
            raise InvalidCacheState(f"restore_batch rows have different layer counts: {[len(r.entries) for r in reads]}")
        codecs, plans = [], []
        for layer in range(n_layers):
            entries = [r.entries[layer] for r in reads]
            codec = self.provider.for_entry(entries[0])
            codecs.append(codec)
            plan_of = getattr(codec, "batch_plan", None)  # a foreign codec may have no direct path
            plans.append(plan_of(entries) if plan_of is not None else None)
        dest = BatchDestinations(plans, [r.entries for r in reads])
        for b, read in enumerate(reads):
            self._fill(read, dest.row(b), also=[r for r in reads if r is not read])
        caches = []
        for layer, (codec, (batched, per_row)) in enumerate(zip(codecs, dest.finish())):
            entries = [r.entries[layer] for r in reads]
            if batched is not None:
                caches.append(codec.adopt_batch(entries, batched))
            else:
                caches.append(codec.load_batch(entries, per_row, verify=False))
        self.counters["batch_layers_direct"] += sum(plan is not None for plan in plans)
        self.counters["batch_layers_fallback"] += sum(plan is None for plan in plans)
        return caches

    def _check_cut(self, manifest: Manifest, p: int) -> None:
        if not 0 <= p <= manifest.length:
            raise InvalidCacheState(f"cannot cut snapshot {manifest.snapshot_id} of {manifest.length} tokens to {p}")
        if p < manifest.length and (not manifest.trimmable or p < manifest.minimum_reusable_offset):
            raise InvalidCacheState(f"snapshot {manifest.snapshot_id} cannot be cut to {p} tokens "
                                    f"(trimmable={manifest.trimmable}, floor={manifest.minimum_reusable_offset})")

    def _check_identity(self, manifest: Manifest) -> None:
        for field in ("model_id", "config_fingerprint", "tokenizer_hash"):
            stored, expected = getattr(manifest, field), getattr(self.identity, field)
            if stored != expected:
                raise IdentityMismatch(field, stored, expected, f"snapshot {manifest.snapshot_id}")

    def _manifest(self, txn, sid: bytes) -> Manifest:
        raw = txn.get(sid, db=self.index.db["manifests"])
        if raw is None:
            raise SnapshotNotFound(f"snapshot {sid.hex()} is not in the store at {self.root}")
        return mf.decode(raw, Manifest, f"manifest {sid.hex()}")

    def _latest(self, txn, session_id: str, namespace: str) -> Manifest:
        """The manifest of the session's latest snapshot (``_explain_missing`` raises when there is none)."""
        skey = self._session_key(session_id, namespace)
        sid = txn.get(skey, db=self.index.db["sessions"])
        if sid is None:
            self._explain_missing(txn, session_id, namespace, skey)
        return self._manifest(txn, sid)

    def _explain_missing(self, txn, session_id: str, namespace: str, skey: bytes):
        raw = txn.get(skey, db=self.index.db["quarantine"])
        if raw is not None:
            sid_hex, reason = msgspec.msgpack.decode(raw)
            raise CorruptData(f"session {session_id!r} (namespace {namespace!r}) was quarantined: snapshot "
                              f"{sid_hex}: {reason}")
        tail = session_id.encode("utf-8", "surrogatepass")
        for key, sid in txn.cursor(db=self.index.db["sessions"]):
            if key[32:] == tail and key[:16] != self.id_key:
                other = self._manifest(txn, sid)
                if other.namespace == namespace:
                    self._check_identity(other)
        raise SnapshotNotFound(f"no session {session_id!r} in namespace {namespace!r} for model "
                               f"{self.identity.model_id!r} in the store at {self.root}")

    def _restore(self, manifest: Manifest, p: int) -> Restored:
        entries, arrays = self._read_arrays(manifest, p)
        caches = [self.provider.for_entry(e).load(e, a, verify=False) for e, a in zip(entries, arrays)]
        return Restored(list(manifest.tokens[:p]), caches, p, manifest.session_id, manifest.snapshot_id,
                        manifest.namespace)

    def _read_arrays(self, manifest: Manifest, p: int) -> tuple[list[CacheEntry], list[list[mx.array]]]:
        """Lease the snapshot, read the blobs covering [0, p) into fresh arrays, verify, release."""
        read = self._open_read(manifest, p)
        try:
            dest = Destinations(read.entries)
            self._fill(read, dest)
            read.ok = True
            return read.entries, dest.finish()
        finally:
            self._close_read(read)

    def _open_read(self, manifest: Manifest, p: int) -> _Read:
        """The entries cut to ``p`` and the blobs covering [0, p), leased (re-reading a manifest compacted since)."""
        for attempt in range(4):
            self.provider.check_provider(manifest.provider)
            entries = list(manifest.entries)
            if p < manifest.length:
                entries = [self.provider.for_entry(e).prefix_entry(e, p) for e in entries]
            needed = [r for r in manifest.chunks if r.start < p] + list(manifest.own)
            try:
                return _Read(manifest, entries, needed, self._lease(manifest, needed))
            except _Stale:  # rewritten in place (compaction) since we read it: same id, same tokens, new chunks
                if attempt == 3:
                    raise
                manifest = self.manifest(manifest.snapshot_id)
        raise AssertionError("unreachable")

    def _fill(self, read: _Read, dest, also: Sequence[_Read] = ()) -> None:
        """Read every needed blob into ``dest``; a blob failing verification releases this read's lease (and those
        of ``also``, reads of the same batch), quarantines the snapshot and raises ``CorruptData``."""
        manifest = read.manifest
        for ref in read.needed:
            try:
                with self.blobs.open(ref.hash, verify=self.verify_reads) as reader:
                    self.counters["bytes_read"] += fill_from_blob(reader, ref, dest)
                    self.counters["blobs_read"] += 1
            except CorruptData as exc:
                for other in (read, *also):
                    self._close_read(other)
                self.quarantine(manifest.snapshot_id, str(exc))
                raise CorruptData(f"session {manifest.session_id!r} (snapshot {manifest.snapshot_id}): chunk "
                                  f"{ref.hash} covering tokens [{ref.start}, {ref.stop}) failed verification: "
                                  f"{exc}; the snapshot is quarantined") from None

    def _close_read(self, read: _Read) -> None:
        """Release the lease once (a successful read also counts as a use of the snapshot)."""
        if read.lease is not None:
            lease, read.lease = read.lease, None
            self._release(lease, bytes.fromhex(read.manifest.snapshot_id) if read.ok else None, read.needed)

    def _lease(self, manifest: Manifest, refs: list[BlobRef]) -> bytes:
        with self._lock:
            self._lease_counter += 1
            key = _be64(os.getpid()) + _be64(self._lease_counter)
        lease = Lease(os.getpid(), time.time() + self.lease_seconds, manifest.snapshot_id, [r.hash for r in refs])

        def put(txn):
            if txn.get(bytes.fromhex(manifest.snapshot_id), db=self.index.db["manifests"]) is None:
                raise _Gone
            # Every blob must still be referenced now: an unreferenced one may already be unlinked (the manifest we
            # hold was rewritten in place since we read it). Referenced + leased in this commit = safe to read.
            if any(txn.get(bytes.fromhex(r.hash), db=self.index.db["chunks"]) is None for r in refs):
                raise _Stale(f"snapshot {manifest.snapshot_id} of session {manifest.session_id!r} was rewritten "
                             f"(compacted) after its manifest was read")
            txn.put(key, mf.encode(lease), db=self.index.db["leases"])

        try:
            self._txn(put)
        except _Gone:
            raise SnapshotNotFound(f"snapshot {manifest.snapshot_id} of session {manifest.session_id!r} was "
                                   f"removed before it could be read") from None
        return key

    def _release(self, key: bytes, touch: bytes | None, refs: list[BlobRef]) -> None:
        """Drop a lease and bump LRU / last-used — deferred into this handle's next write transaction (or a timer
        0.5 s later, or close), so a restore costs one synced LMDB commit instead of two."""
        with self._lock:
            self._deferred.append((key, touch, [r.hash for r in refs], _now_ns()))
            if touch is not None:
                self._touched[touch] = self._deferred[-1][3]
            if self._deferred_timer is None and not self._closing:
                self._deferred_timer = threading.Timer(0.5, self._flush_deferred)
                self._deferred_timer.daemon = True
                self._deferred_timer.start()

    def _flush_deferred(self) -> None:
        # Never hold self._lock across a transaction: transaction bodies take it (lock order: index, then store).
        with self._lock:
            self._deferred_timer = None
            go = bool(self._deferred) and not self._closing
        if go:
            self._txn(lambda txn: None)

    def _txn(self, fn, unlink: Sequence[str] = ()):
        """One write transaction of this handle: deferred lease releases first, then unlinking the blobs among
        ``unlink`` and the released leases' that are unreferenced and unleased (under the writer lock), then ``fn``."""
        with self._lock:
            pending = list(self._deferred)

        def run(txn):
            for item in pending:
                self._apply_release(txn, *item)
            candidates = set(unlink).union(*(item[2] for item in pending))
            if candidates:  # blobs freed while we (or a lease we released) held them
                held = self._live_leases(txn)[1]
                for h in candidates:
                    if h not in held and txn.get(bytes.fromhex(h), db=self.index.db["chunks"]) is None:
                        self.blobs.delete(h)
            return fn(txn)

        result = self.index.write(run)
        with self._lock:  # by key: a concurrent _txn (timer thread) may have applied and removed some already
            done = {item[0] for item in pending}
            self._deferred = [item for item in self._deferred if item[0] not in done]
            for _key, touch, _hashes, when in pending:
                if touch is not None and self._touched.get(touch) == when:
                    del self._touched[touch]
        return result

    def _apply_release(self, txn, key: bytes, touch: bytes | None, hashes: list[str], now: int) -> None:
        db = self.index.db
        txn.delete(key, db=db["leases"])
        if touch is None:
            return
        raw = txn.get(touch, db=db["summaries"])
        if raw is None:
            return
        s = mf.decode(raw, Summary, "summary")
        txn.delete(s.id_key + _be64(s.last_used_ns) + touch, db=db["lru"])
        txn.put(s.id_key + _be64(now) + touch, b"", db=db["lru"])
        txn.put(touch, mf.encode(Summary(s.id_key, s.ns_key, s.session_id, s.namespace, s.length,
                                         s.minimum_reusable_offset, s.trimmable, s.nbytes, s.created_at, now)),
                db=db["summaries"])
        for h in hashes:
            k = bytes.fromhex(h)
            raw = txn.get(k, db=db["chunks"])
            if raw is not None:
                m = mf.decode(raw, ChunkMeta, "chunk record")
                txn.put(k, mf.encode(ChunkMeta(m.refs, m.nbytes, m.stored_bytes, m.encoding, now)), db=db["chunks"])

    # ------------------------------------------------------------------ management
    def quarantine(self, snapshot_id: str, reason: str) -> None:
        """Hide a snapshot for good: removed from the index, its manifest file renamed ``.quarantined``."""
        sid = bytes.fromhex(snapshot_id)

        def drop(txn):
            raw = txn.get(sid, db=self.index.db["summaries"])
            if raw is None:
                return None
            s = mf.decode(raw, Summary, "summary")
            freed = self._drop(txn, sid)
            skey = s.id_key + s.ns_key + s.session_id.encode("utf-8", "surrogatepass")
            if txn.get(skey, db=self.index.db["sessions"]) is None:
                txn.put(skey, msgspec.msgpack.encode([snapshot_id, reason[:2000]]), db=self.index.db["quarantine"])
            return freed

        freed = self._txn(drop)
        if freed is not None:
            self.counters["quarantined"] += 1
            self._after_drop(sid, freed, quarantine=True)

    def delete(self, session_id: str, namespace: str = "") -> None:
        """Remove the session's snapshot; chunks no other snapshot references are freed."""
        inputs.check_session(session_id, namespace)
        self._check_scoped("delete")
        skey = self._session_key(session_id, namespace)

        def drop(txn):
            sid = txn.get(skey, db=self.index.db["sessions"])
            if sid is None:
                return None
            return sid, self._drop(txn, sid)

        result = self._txn(drop)
        if result is None:
            raise SnapshotNotFound(f"no session {session_id!r} in namespace {namespace!r} to delete")
        self._after_drop(*result)

    def sessions(self, namespace: str | None = None) -> list[SessionInfo]:
        """This identity's sessions (all namespaces when ``namespace`` is None), most recently used first."""
        inputs.check_optional_namespace(namespace)
        self._check_scoped("sessions")
        prefix = self.id_key if namespace is None else self.id_key + self._ns_key(namespace)
        out = []
        with self.index.read() as txn:
            cur = txn.cursor(db=self.index.db["sessions"])
            if cur.set_range(prefix):
                for key, sid in cur:
                    if not key.startswith(prefix):
                        break
                    raw = txn.get(sid, db=self.index.db["summaries"])
                    if raw is None:
                        continue
                    s = mf.decode(raw, Summary, "summary")
                    out.append(SessionInfo(s.session_id, s.namespace, sid.hex(), s.length, s.nbytes, s.created_at,
                                           s.last_used_ns / 1e9))
        out.sort(key=lambda s: -s.last_used)
        return out

    def stats(self) -> dict[str, Any]:
        """Counts and bytes: this identity's snapshots, the whole store's blobs, and this handle's counters."""
        self._check_open()
        with self.index.read() as txn:
            total = self.index.meta_int(txn, b"total_bytes")
            n_chunks = txn.stat(self.index.db["chunks"])["entries"]
            n_snapshots_all = txn.stat(self.index.db["manifests"])["entries"]
            own = own_bytes = 0
            cur = txn.cursor(db=self.index.db["lru"])
            if self.id_key is not None and cur.set_range(self.id_key):
                for key in cur.iternext(keys=True, values=False):
                    if not key.startswith(self.id_key):
                        break
                    own += 1
                    s = mf.decode(txn.get(key[24:40], db=self.index.db["summaries"]), Summary, "summary")
                    own_bytes += s.nbytes
            n_quarantined = txn.stat(self.index.db["quarantine"])["entries"]
        return {"root": self.root, "model_id": None if self.identity is None else self.identity.model_id,
                "snapshots": own,
                "snapshot_bytes": own_bytes, "snapshots_all_identities": n_snapshots_all, "blobs": n_chunks,
                "stored_bytes": total, "max_bytes": self.max_bytes, "quarantined_sessions": n_quarantined,
                "pending_bytes": self._writer.pending_bytes, **self.counters}

    def verify(self, deep: bool = False):
        """Inconsistencies between index and blobs (empty list: clean). ``deep`` re-hashes every blob."""
        from .maintenance import verify_store

        self._check_open()
        return verify_store(self, deep)

    def gc(self, dry_run: bool = True):
        """Remove crash residue: unreferenced blobs and manifest files, dead tmp files, expired leases."""
        from .maintenance import gc_store

        self._check_open()
        return gc_store(self, dry_run)

    def rebuild_index(self) -> int:
        """Rebuild the LMDB index from the manifest files and blobs; returns the number of snapshots indexed."""
        from .maintenance import rebuild_store_index

        self._check_open()
        return rebuild_store_index(self)

    # ------------------------------------------------------------------ for offline tools (kvshelf.tools)
    def manifest(self, snapshot_id: str) -> Manifest:
        """A snapshot's manifest by id (any identity)."""
        snapshot_id = inputs.check_snapshot_id(snapshot_id)
        with self.index.read() as txn:
            return self._manifest(txn, bytes.fromhex(snapshot_id))

    def iter_manifests(self) -> Iterator[Manifest]:
        """Every indexed manifest, all identities (a snapshot of the index taken at the first call)."""
        with self.index.read() as txn:
            raws = [bytes(v) for _k, v in txn.cursor(db=self.index.db["manifests"])]
        for raw in raws:
            yield mf.decode(raw, Manifest, "manifest")

    def chunk_info(self, hash_: str) -> ChunkMeta | None:
        """Refcount, payload bytes, stored bytes, encoding and last use of an indexed blob."""
        with self.index.read() as txn:
            raw = txn.get(bytes.fromhex(hash_), db=self.index.db["chunks"])
        return None if raw is None else mf.decode(raw, ChunkMeta, f"chunk record {hash_}")

    def iter_chunks(self) -> Iterator[tuple[str, ChunkMeta]]:
        with self.index.read() as txn:
            rows = [(bytes(k).hex(), bytes(v)) for k, v in txn.cursor(db=self.index.db["chunks"])]
        for h, raw in rows:
            yield h, mf.decode(raw, ChunkMeta, f"chunk record {h}")

    def leased_hashes(self) -> set[str]:
        """Blob hashes that live readers hold right now (never rewrite or remove these)."""
        with self.index.read() as txn:
            return self._live_leases(txn)[1]

    def open_blob(self, hash_: str, verify: bool = True) -> BlobReader:
        """A reader over one blob in whatever encoding it is stored (raw safetensors or zstd)."""
        return self.blobs.open(hash_, verify)

    def summaries(self) -> dict[str, Summary]:
        """Every indexed snapshot's summary record, all identities: snapshot id -> ``Summary`` (scope keys, session,
        namespace, length, floor, trimmable, bytes, created, last used). Identity-blind, for offline tools."""
        self._check_open()
        with self.index.read() as txn:
            rows = [(bytes(k).hex(), bytes(v)) for k, v in txn.cursor(db=self.index.db["summaries"])]
        return {sid: mf.decode(raw, Summary, f"summary {sid}") for sid, raw in rows}

    @contextmanager
    def lease(self, snapshot: Manifest | str, hashes: Sequence[str] | None = None) -> Iterator[Manifest]:
        """Hold a reader's lease on a snapshot's blobs (all of them unless ``hashes`` names some) for the block:
        no eviction, gc or recompression unlinks or rewrites them meanwhile. ``SnapshotNotFound`` when the snapshot
        is gone. Yields the manifest. Leaving the block releases the lease without counting as a use; blobs that lost
        their last reference meanwhile are left for ``gc`` (they are not unlinked here)."""
        self._check_open()
        manifest = snapshot if isinstance(snapshot, Manifest) else self.manifest(snapshot)
        refs = list(manifest.blobs) if hashes is None else [BlobRef(h, 0, 0, 0) for h in hashes]
        key = self._lease(manifest, refs)
        try:
            yield manifest
        finally:
            self._release(key, None, [])

    def put_blobs(self, items: Sequence[tuple[BlobRef, list[Piece]]]) -> list[str]:
        """Write the chunk blobs not already stored (raw, durable, named by ``ref.hash``, which must be the content
        hash of the pieces); returns the hashes written. Hold ``save_gate()`` (shared) from this call until the
        blobs are referenced by a commit, or a concurrent gc may take them for crash residue."""
        new, seen = [], set()
        for ref, pieces in items:
            if ref.hash not in seen and self.blobs.has(ref.hash) is None:
                if (got := content_hash(pieces)) != ref.hash:
                    raise CorruptData(f"blob pieces hash to {got}, not to the name {ref.hash}")
                new.append((ref, pieces))
                seen.add(ref.hash)
        self.blobs.put_many([(r.hash, pieces, self.blob_metadata(r)) for r, pieces in new])
        return [r.hash for r, _ in new]

    def rewrite_blob(self, hash_: str, encoding: str, *, level: int = 3) -> int | None:
        """Re-store a blob in ``encoding`` ("raw" or "zstd", at zstd ``level``) under the same hash; returns stored
        bytes (None: skipped).

        The content is read and verified first; the manifests do not change. Leased or unreferenced blobs are skipped,
        and so is a blob already in ``encoding`` (a zstd blob is not recompressed at another level).
        """
        if encoding not in ("raw", "zstd"):
            raise ValueError(f"encoding must be 'raw' or 'zstd', got {encoding!r}")
        if not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"zstd level must be an int in 1..22, got {level!r}")
        with self.save_gate():
            info = self.chunk_info(hash_)
            if info is None or info.encoding == encoding or hash_ in self.leased_hashes():
                return None
            with self.blobs.open(hash_, verify=True) as reader:
                bufs = reader.read_into([None] * len(reader.tensors))
                pieces = [Piece(t.name, t.dtype, t.shape, b) for t, b in zip(reader.tensors, bufs)]
                metadata = dict(reader.metadata)
            stored = self.blobs.put(hash_, pieces, metadata, encoding, level=level)

            def update(txn):
                key = bytes.fromhex(hash_)
                raw = txn.get(key, db=self.index.db["chunks"])
                if raw is None:
                    return
                m = mf.decode(raw, ChunkMeta, "chunk record")
                total = self.index.meta_int(txn, b"total_bytes") - m.stored_bytes + stored
                self.index.set_meta_int(txn, b"total_bytes", total)
                txn.put(key, mf.encode(ChunkMeta(m.refs, m.nbytes, stored, encoding, m.last_used_ns)),
                        db=self.index.db["chunks"])

            self._txn(update)
            return stored

    def replace_manifest(self, snapshot_id: str, new: Manifest, *, expected: Manifest | None = None) -> bool:
        """Atomically swap a snapshot's manifest for ``new`` (same session; its blobs must already be stored).

        Everything is re-checked inside the one write transaction: the snapshot must still be indexed, still be its
        session's latest, and (when ``expected`` is given: the manifest ``new`` was derived from) still hold exactly
        ``expected``. Otherwise nothing changes and False is returned (a save or another compaction won the race);
        the manifest file is put back as the index has it. True when swapped. Blobs the swap freed are unlinked
        unless leased (a caller keeps them for readers by leasing them: ``lease``); ``gc`` takes them later.
        """
        self._check_open()
        sid = bytes.fromhex(snapshot_id)
        if new.snapshot_id != snapshot_id:
            raise InvalidCacheState(f"replace_manifest keeps the snapshot id ({snapshot_id}), got {new.snapshot_id}")
        base = expected if expected is not None else self.manifest(snapshot_id)
        if (new.session_id, new.namespace, identity_key_of(new)) != (base.session_id, base.namespace,
                                                                     identity_key_of(base)):
            raise InvalidCacheState("replace_manifest keeps the session, namespace and identity of the snapshot")
        skey = identity_key_of(base) + namespace_key(identity_key_of(base), base.namespace) \
            + base.session_id.encode("utf-8", "surrogatepass")
        db = self.index.db

        def swap(txn):
            current = txn.get(sid, db=db["manifests"])
            if current is None or txn.get(skey, db=db["sessions"]) != sid or (
                    expected is not None and bytes(current) != mf.encode(expected)):
                # lost the race: put the manifest file back as the index has it (we hold the writer lock)
                if current is None:
                    self.blobs.delete_manifest(snapshot_id)
                else:
                    self.blobs.put_manifest(snapshot_id, bytes(current))
                return None
            return self._commit(txn, new, replaces=sid)

        with self.save_gate():
            self.blobs.put_manifest(new.snapshot_id, mf.encode(new))
            result = self._txn(swap)
        if result is None:
            return False
        self._reclaim(result[1])
        return True

    def replace_snapshot(self, old: Manifest, new: Manifest,
                         blobs: Mapping[str, list[Piece]] | Sequence[tuple[BlobRef, list[Piece]]] = ()) -> bool:
        """Rewrite a snapshot in place (same id, same session, e.g. compacted chunks): write the new blobs under the
        save gate, swap the manifest atomically (``replace_manifest(expected=old)``), with ``old``'s blobs leased
        across the swap so a reader that fetched the old manifest still finds every blob it names. The replaced blobs
        are never unlinked here: they become unreferenced and ``gc`` removes them (run it a grace period later).

        Returns False (and unlinks the new blobs it wrote that nothing references) when the snapshot was replaced,
        removed or rewritten meanwhile; raises ``SnapshotNotFound`` when it is already gone at the start."""
        if isinstance(blobs, Mapping):
            refs = {r.hash: r for r in new.blobs}
            items = [(refs[h], pieces) for h, pieces in blobs.items()]
        else:
            items = list(blobs)
        with self.lease(old):
            written: list[str] = []
            swapped = False
            with self.save_gate():
                try:
                    for _attempt in range(5):
                        written += self.put_blobs(items)
                        try:
                            swapped = self.replace_manifest(old.snapshot_id, new, expected=old)
                            break
                        except _MissingBlobs:  # present when checked, reaped (unreferenced) before the commit
                            continue
                    else:  # pragma: no cover - needs five lost races in a row
                        raise KvShelfError(f"could not rewrite snapshot {old.snapshot_id}: blobs kept vanishing")
                finally:
                    if not swapped:
                        self._reclaim(written)
        return swapped

    # ------------------------------------------------------------------ offline: this handle alone
    @contextmanager
    def exclusive(self, timeout: float = 10.0) -> Iterator[None]:
        """Hold the store alone for an offline job (index compaction, ``rebuild_index``): no other process has it
        open (``locks/open.lock``, see ``openlock.py``), no other handle of this process does, no save is in flight
        (save gate held exclusively) and this process commits nothing else meanwhile. Raises ``StoreBusy`` naming
        who is in the way; other processes opening the store wait until the block ends."""
        self._check_open()
        self.flush()
        if self._deferred:
            self._txn(lambda txn: None)
        if openlock.users(self._lock_key) > 1 or self.index.users > 1:
            raise StoreBusy(f"other store handles in this process have {self.root} open")
        try:
            gate = self.save_gate(exclusive=True, timeout=timeout)
            gate.__enter__()
        except TimeoutError:
            raise StoreBusy(f"saves kept the store at {self.root} busy for {timeout:.0f}s") from None
        try:
            with self.index.writer_lock(), openlock.exclusive(self._lock_key):
                yield
        finally:
            gate.__exit__(None, None, None)

    def replace_index(self, install: Callable[[str], None]) -> None:
        """Inside ``exclusive()``: close the LMDB environment, run ``install(index_dir)`` (e.g. rename a compacted
        copy over ``data.mdb``, or clear the directory for a rebuild), then open the index again."""
        self._check_open()
        if not openlock.is_exclusive(self._lock_key):
            raise StoreBusy("replace_index needs the store held exclusively (use it inside store.exclusive())")
        path = self.index.path
        map_size = self.index.env.info()["map_size"]
        self.index.close()
        try:
            install(path)
        finally:
            self.index = Index(path, map_size=map_size)


def identity_key_of(manifest: Manifest) -> bytes:
    from .identity import identity_key

    return identity_key(manifest.model_id, manifest.config_fingerprint, manifest.tokenizer_hash)


def open_store(path: str | os.PathLike, identity: Identity | None = None, *, max_bytes: int | None = None,
               chunk_tokens: int = 256, admin: bool = False, **options: Any) -> Store:
    """Open (creating if needed) the store at ``path`` under ``identity`` (use as a context manager).

    ``admin=True`` without an identity opens it identity-blind for offline tools (see ``Store``)."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise WrongArgumentType(f"open_store needs a str or os.PathLike store path, got {type(path).__name__}")
    if identity is None and not admin:
        raise WrongArgumentType("open_store needs identity=Identity(model_id, ...): snapshots are only reused for their model")
    return Store(path, identity, max_bytes=max_bytes, chunk_tokens=chunk_tokens, admin=admin, **options)


__all__ = ["Store", "StoreBusy", "open_store"]
