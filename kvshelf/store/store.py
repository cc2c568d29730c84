"""The session store façade: one directory, an index (LMDB) and a byte store (packs), opened under one identity.

The rooms behind it, one concern each: ``keys`` (every key layout), ``ledger`` (commit / drop / refcounts),
``leasing`` + ``leases`` (write transactions, readers' leases, the one place objects are unlinked), ``saving``
(capture → one pack → one commit), ``restoring`` (straight into the final MLX arrays), ``budget`` (eviction),
``surface`` (the offline tools' calls), ``maintenance`` (verify, gc, rebuild), ``lookup`` (the prefix search),
``fulldisk`` + ``reserve`` + ``objlocks`` (a full disk never blocks a read, a delete or a gc).

Durability order: a save's pack (chunks + its manifest in the trailer) is fsynced and renamed, its directory fsynced,
then ONE LMDB write transaction indexes it. Objects that lost their last reference are unlinked only in a later
write transaction that re-checks the ledger and the live leases, so a crash leaves at most unreferenced packs (``gc``).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import msgspec

from ..codecs import CodecProvider, default_provider
from ..errors import (CorruptData, IdentityMismatch, InvalidCacheState, KvShelfError, SnapshotNotFound,
                      WrongArgumentType)
from . import inputs
from .index import keys, ledger
from .liveness import object_locks as objlocks, open_lock as openlock, removers_lock as removers
from .save import saver as saving
from .integrity import legacy_v1 as sealing
from .index import schema as mf
from .objects.protocol import put_unsynced
from .space.budget import evict_to_budget
from .liveness.removers_lock import RemoversLock
from .space.full_disk import FullDiskMixin
from .space.pins import Pins
from .identity import Identity, namespace_key
from .index.lmdb_env import Index
from .index.protocol import IndexStore
from .liveness.lease_files import LeaseBook
from .liveness.leasing import LeasingMixin
from .objects.local import LocalByteStore, ensure_dir
from .prefix.search import LazyTokens, _Lookup
from .index.schema import Manifest
from .liveness.open_lock import StoreBusy
from .prefix.hashing import BLOCK_TOKENS
from .results import PrefixHit, SessionInfo, SnapshotInfo
from .integrity.quarantine import QuarantineMixin
from .restore.reader import ReadingMixin
from .admin.surface import ToolsSurface
from .save.hash_reuse import UnchangedBook
from .save.background import BackgroundWriter
from .save.checkpoints import Checkpoints, is_checkpoint, parent_of


class Store(LeasingMixin, ReadingMixin, QuarantineMixin, FullDiskMixin, ToolsSurface):
    """One store directory opened under one ``Identity``. Thread-safe; several processes may open it at once.

    ``admin=True`` (with no identity) opens it identity-blind for offline tools: the tools surface works on every
    identity's snapshots, while the identity-scoped calls (save, restore, lookup, sessions, delete) refuse.
    ``byte_store`` replaces the local directory of packs by any ``backend.ByteStore`` and ``index_store`` the LMDB
    index by any ``indexstore.IndexStore`` (``MemoryIndexStore``: a throwaway store); the store speaks only those
    two protocols. The directory still holds the locks (and, by default, both of them).
    """

    def __init__(self, path: str | os.PathLike, identity: Identity | None, *, max_bytes: int | None = None,
                 chunk_tokens: int = 256, verify: bool = True, provider: CodecProvider | None = None,
                 map_size: int = 64 << 30, max_pending_bytes: int = 2 << 30, lease_seconds: float = 600.0,
                 admin: bool = False, byte_store=None, index_store=None):
        if index_store is not None and not isinstance(index_store, IndexStore):
            raise WrongArgumentType(f"index_store must be a kvshelf IndexStore, got {type(index_store).__name__}")
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
        self.bytes = byte_store if byte_store is not None else LocalByteStore(self.root,
                                                                              os.path.join(self.root, "tmp"))
        if isinstance(self.bytes, LocalByteStore):
            ensure_dir(os.path.join(self.root, "packs"))  # made once here, not inside a save (its own fsync)
        lock_dir = os.path.join(self.root, "locks")
        ensure_dir(lock_dir)
        self._gate_path = os.path.join(lock_dir, "save.lock")
        os.close(os.open(self._gate_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self.removers = RemoversLock(os.path.join(lock_dir, "removers.lock"))  # removers.py
        objlocks.make_sentinel(self.root)
        self._lock_key = os.path.realpath(self.root)
        openlock.acquire(self._lock_key)  # before LMDB maps the index: "open" is exact (openlock.py)
        try:
            reap = getattr(self.bytes, "reap_tmp", None)
            if reap is not None:
                reap()
            self.index = (index_store if index_store is not None else
                          Index(os.path.join(self.root, "index"), map_size=map_size))
        except BaseException:
            openlock.release(self._lock_key)
            raise
        self.leases = LeaseBook(self.root)
        self.pins = Pins(self.index, self.id_key, lambda: self.max_bytes, self.root)  # space/pins.py
        self.block = BLOCK_TOKENS
        self._lock = threading.RLock()
        self._init_leasing()
        self._writer = BackgroundWriter(max_pending_bytes)
        self.counters = {"blobs_read": 0, "bytes_read": 0, "blobs_written": 0, "bytes_written": 0,
                         "bytes_reused": 0, "lookups": 0, "hits": 0, "quarantined": 0, "evicted": 0,
                         "batch_layers_direct": 0, "batch_layers_fallback": 0, "chunks_hashed": 0,
                         "bytes_hashed": 0, "chunks_hash_reused": 0, "bytes_hash_reused": 0}
        self._unchanged = UnchangedBook()  # each session's last save here: hashes a grown save may reuse
        self.checkpoints = Checkpoints(lambda: self.index, self._session_key, self._save_derived,  # save/checkpoints.py
                                       lambda sid, toks, caches, ns: saving.capture(self, sid, toks, caches, ns),
                                       lambda cap: self._published(saving.write(self, cap)))
        self._closed = self._closing = False
        self.tier = None  # the shared tier (kvshelf.store.remote), attached by open_store(remote=...)
        self._init_fulldisk()  # sizes and takes the reserve (reserve.py) now that the index can say what it needs
        sealing.seal_v1_manifests(self)  # once per index: v1 manifest files get the checksum rebuilds rely on

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
        if self.tier is not None:  # after queued saves: they publish too
            self.tier.close()
        with self._lock:
            self._closing = True
            timer, self._touch_timer = self._touch_timer, None
        if timer is not None:
            timer.cancel()
            timer.join()
        try:
            if self._touches:
                try:
                    self._txn(lambda txn: None)
                except KvShelfError:  # damaged records or a full disk: uses are LRU order only, never data
                    pass
        finally:
            self._closed = True
            self.leases.close()
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
        """The store-wide save gate (``locks/save.lock``, flock): saves hold it shared from their first write to
        their commit; orphan sweeps and offline jobs hold it exclusively, so an in-flight save's pack is never
        taken for crash residue. ``StoreBusy`` when it cannot be had within ``timeout`` seconds."""
        fd = os.open(self._gate_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreBusy(f"the save gate of {self.root} stayed busy for {timeout:g}s (a gc, "
                                        f"compaction or offline job holds it{'' if exclusive else ' exclusively'})")
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
        return keys.session_key(self.id_key, self._ns_key(namespace), session_id)

    # ------------------------------------------------------------------ saving
    def save(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "",
             checkpoints: dict[int, Sequence[Any]] | None = None) -> SnapshotInfo:
        """Persist the caches for ``tokens`` as the session's latest snapshot (only new chunks are written).
        ``checkpoints={k: caches_at_k}`` also saves the state after ``tokens[:k]`` (docs/CHECKPOINTS.md)."""
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self._check_scoped("save")
        if checkpoints:
            self.checkpoints.ordered(saving.tokens_array(tokens), checkpoints)  # refused before anything is written
        info = self._published(saving.write(self, saving.capture(self, session_id, tokens, caches, namespace)))
        if checkpoints:  # checkpoints (save/checkpoints.py): after the session, so they share its chunks
            self.checkpoints.save_many(session_id, saving.tokens_array(tokens), checkpoints, namespace)
        return info

    # --- checkpoints (save/checkpoints.py) ---------------------------------------------------------------------------
    def save_checkpoint(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any],
                        namespace: str = "") -> SnapshotInfo:
        """Save ``caches`` (the state after ``tokens`` = the session's first k tokens) as a checkpoint of the
        existing session at k: lookups reuse it for prompts that match those k tokens (docs/CHECKPOINTS.md)."""
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self._check_scoped("save_checkpoint")
        return self.checkpoints.save(session_id, tokens, caches, namespace)

    def list_checkpoints(self, session_id: str, namespace: str = "") -> list:
        """The session's checkpoints (``CheckpointInfo``: length, snapshot id, bytes referenced), by length."""
        inputs.check_session(session_id, namespace)
        self._check_scoped("list_checkpoints")
        return self.checkpoints.listed(session_id, namespace)

    def _save_derived(self, derived_id: str, tokens, caches: Sequence[Any], namespace: str) -> SnapshotInfo:
        return self._published(saving.write(self, saving.capture(self, derived_id, tokens, caches, namespace)))

    def save_async(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any],
                   namespace: str = "", checkpoints: dict[int, Sequence[Any]] | None = None) -> Future:
        """Snapshot and evaluate now, write in the background; ``flush()`` waits and re-raises failures.
        ``checkpoints`` as in ``save``: captured now too, written right after the session."""
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self._check_scoped("save_async")
        cap = saving.capture(self, session_id, tokens, caches, namespace)
        if not checkpoints:
            return self._writer.submit(lambda: self._published(saving.write(self, cap)), cap.nbytes)
        ckpts = self.checkpoints.capture_many(session_id, saving.tokens_array(tokens), checkpoints, namespace)

        def write_all() -> SnapshotInfo:  # the session first: its checkpoints share its chunks and need it
            info = self._published(saving.write(self, cap))
            self.checkpoints.write_captured(session_id, namespace, ckpts)
            return info

        return self._writer.submit(write_all, cap.nbytes + sum(c.nbytes for c in ckpts))

    def _published(self, info: SnapshotInfo) -> SnapshotInfo:
        """Local-durable first; then the reserve grows with the longest snapshot (a delete of it must fit on a full
        disk); then the shared tier (if any) queues it for publishing, never waiting."""
        self._keep_reserve(info.length)
        if self.tier is not None:
            try:
                self.tier.saved(self.manifest(info.snapshot_id))
            except SnapshotNotFound:  # already evicted or replaced: nothing to publish
                pass
        return info

    def flush(self) -> None:
        self._writer.flush()

    blob_metadata = staticmethod(saving.chunk_metadata)

    def _evict_to_budget(self, protect: bytes | None = None) -> int:
        return evict_to_budget(self, protect)

    def _remove(self, txn, sid: bytes, reason: str = "") -> tuple[bytes, list[str], bytes] | None:
        """Drop a snapshot for good (delete, eviction, quarantine) in ``txn``: (sid, objects freed, tombstone)."""
        raw = txn.get("summaries", sid)
        if raw is None:
            return None
        s = mf.decode(raw, mf.Summary, f"summary {sid.hex()}")
        self.pins.forget(txn, s)  # a removed session keeps no pin (space/pins.py)
        tomb = msgspec.msgpack.encode([keys.summary_session_key(s), s.created_at, reason])
        freed = ledger.drop(self.index, txn, sid)
        freed += self.checkpoints.drop_along(txn, s, lambda c: ledger.drop(self.index, txn, c))  # taken along
        return sid, freed, tomb

    def _after_drop(self, dropped: bytes, freed: list[str], tomb: bytes, quarantined: bool = False) -> None:
        """After a delete / eviction / quarantine: leave a tombstone (the session and its creation time, so
        ``rebuild_index`` never brings back this snapshot or an older one of its session from a pack that outlives
        it; not synced: it only matters if the index is lost) and unlink what is dead (the caller holds
        ``removers.removing()`` from before its commit)."""
        removers.before_unlink()
        self._reclaim(freed)
        try:
            put_unsynced(self.bytes, keys.tomb(dropped.hex(), quarantined=quarantined), [tomb])
        except (KvShelfError, OSError):  # e.g. a full disk: the removal itself is committed; only a rebuild of a
            pass                         # lost index could bring the snapshot back

    # ------------------------------------------------------------------ lookup
    def lookup(self, prompt_tokens: Sequence[int], namespace: str = "") -> PrefixHit | None:
        """The longest usable stored prefix of the prompt (API.md rule), or None. Reads no chunks.

        A list prompt is converted (and checked) only as far as the lookup reads it, so a miss costs microseconds
        however long the prompt; arrays are converted whole (that is cheap)."""
        prompt_tokens, _ = inputs.check_prompt(prompt_tokens), inputs.check_namespace(namespace)
        self._check_scoped("lookup")
        prompt = LazyTokens(prompt_tokens, "prompt_tokens")
        nsk = self._ns_key(namespace)
        self.counters["lookups"] += 1
        with self.index.read() as txn:
            best = _Lookup(self, txn, nsk, prompt).run()
        hit = None if best is None else PrefixHit(best[1].session_id, best[2].hex(), best[0], best[1].namespace,
                                                  best[1].length)
        if self.tier is not None:  # local first; the shared tier only when it gives a longer prefix
            hit = self.tier.lookup(prompt, namespace, hit)
        parent = None if hit is None else parent_of(hit.session_id)
        if parent is not None:  # a checkpoint (save/checkpoints.py): reported as its session's
            hit = PrefixHit(parent[0], hit.snapshot_id, hit.length, hit.namespace, hit.snapshot_length, True)
        if hit is not None:
            self.counters["hits"] += 1
        return hit

    def _has(self, snapshot_id: str) -> bool:
        with self.index.read() as txn:
            return txn.get("manifests", bytes.fromhex(snapshot_id)) is not None

    def stats(self) -> dict[str, Any]:
        doc = super().stats()
        doc["pinned_bytes"] = self.pins.pinned_bytes()  # space/pins.py
        return {**doc, "remote": self.tier.stats()} if self.tier is not None else doc

    # ------------------------------------------------------------------ records
    def _check_identity(self, manifest: Manifest) -> None:
        for name in ("model_id", "config_fingerprint", "tokenizer_hash"):
            stored, expected = getattr(manifest, name), getattr(self.identity, name)
            if stored != expected:
                raise IdentityMismatch(name, stored, expected, f"snapshot {manifest.snapshot_id}")

    def _manifest(self, txn, sid: bytes) -> Manifest:
        raw = txn.get("manifests", sid)
        if raw is None:
            raise SnapshotNotFound(f"snapshot {sid.hex()} is not in the store at {self.root}")
        return mf.decode(raw, Manifest, f"manifest {sid.hex()}")

    def _latest(self, txn, session_id: str, namespace: str) -> Manifest:
        """The manifest of the session's latest snapshot (``_explain_missing`` raises when there is none)."""
        skey = self._session_key(session_id, namespace)
        sid = txn.get("sessions", skey)
        if sid is None:
            self._explain_missing(txn, session_id, namespace, skey)
        raw = txn.get("manifests", sid)
        where = f"session {session_id!r} (namespace {namespace!r})"
        if raw is None:  # one read transaction: a session pointing nowhere is a damaged record, not a race
            raise CorruptData(f"{where} points to snapshot {bytes(sid).hex()}, which is not indexed "
                              f"(a damaged index record: run `kvshelf verify`)")
        m = mf.decode(raw, Manifest, f"manifest {bytes(sid).hex()} of {where}")
        if (m.session_id, m.namespace) != (session_id, namespace) or keys.identity_key_of(m) != self.id_key:
            raise CorruptData(f"{where} points to snapshot {m.snapshot_id} of session {m.session_id!r} "
                              f"(namespace {m.namespace!r}): a damaged index record, refused")
        return m

    def _explain_missing(self, txn, session_id: str, namespace: str, skey: bytes):
        raw = txn.get("quarantine", skey)
        if raw is not None:
            try:
                sid_hex, reason = msgspec.msgpack.decode(raw)
            except (msgspec.DecodeError, ValueError, TypeError):
                sid_hex, reason = "?", "its quarantine record is damaged too"
            raise CorruptData(f"session {session_id!r} (namespace {namespace!r}) was quarantined: snapshot "
                              f"{sid_hex}: {reason}")
        tail = session_id.encode("utf-8", "surrogatepass")
        for key, sid in txn.range("sessions"):
            if key[32:] == tail and key[:16] != self.id_key:
                other = self._manifest(txn, sid)
                if other.namespace == namespace:
                    self._check_identity(other)
        raise SnapshotNotFound(f"no session {session_id!r} in namespace {namespace!r} for model "
                               f"{self.identity.model_id!r} in the store at {self.root}")

    # ------------------------------------------------------------------ management
    def delete(self, session_id: str, namespace: str = "") -> None:
        """Remove the session's snapshot; chunks no other snapshot references are freed."""
        inputs.check_session(session_id, namespace)
        self._check_scoped("delete")
        skey = self._session_key(session_id, namespace)

        def drop(txn):
            sid = txn.get("sessions", skey)
            had_quarantine = txn.delete("quarantine", skey)  # the operator's "drop it"
            self.checkpoints.drop_quarantined(txn, skey)  # and its checkpoints' (save/checkpoints.py)
            if sid is None:
                return "quarantine" if had_quarantine else None
            return self._remove(txn, bytes(sid))

        with self.removers.removing():  # from the commit to the unlink (verify tells residue from this)
            result = self._freeing_txn(drop)
            if result == "quarantine":
                return
            if result is None:
                raise SnapshotNotFound(f"no session {session_id!r} in namespace {namespace!r} to delete")
            self._after_drop(*result)
        self._keep_reserve()  # space was freed: hold back again what the next delete may need

    # ------------------------------------------------------------------ pins (space/pins.py)
    def pin(self, session_id: str, namespace: str = "", ttl: float | None = None):
        """Never evict the session (budget, LRU) until ``unpin`` or ``ttl`` seconds after its last use."""
        inputs.check_session(session_id, namespace)
        self._check_open()
        return self.pins.pin(session_id, namespace, ttl)

    def unpin(self, session_id: str, namespace: str = "") -> bool:
        """Drop the session's pin (False when it had none); the budget may evict it again."""
        inputs.check_session(session_id, namespace)
        self._check_open()
        return self.pins.unpin(session_id, namespace)

    def sessions(self, namespace: str | None = None) -> list[SessionInfo]:
        """This identity's sessions (all namespaces when ``namespace`` is None), most recently used first."""
        inputs.check_optional_namespace(namespace)
        self._check_scoped("sessions")
        prefix = self.id_key if namespace is None else self.id_key + self._ns_key(namespace)
        touched = self._touched()
        out = []
        with self.index.read() as txn:
            for key, sid in txn.range("sessions", prefix, keys.after_prefix(prefix)):
                raw = txn.get("summaries", sid)
                if raw is None:
                    continue
                s = mf.decode(raw, mf.Summary, "summary")
                if is_checkpoint(s.session_id):  # a session's checkpoint, not a session (list_checkpoints)
                    continue
                used = max(s.last_used_ns, touched.get(bytes(sid), 0))
                out.append(SessionInfo(s.session_id, s.namespace, bytes(sid).hex(), s.length, s.nbytes,
                                       s.created_at, used / 1e9))
        out.sort(key=lambda s: -s.last_used)
        return out


def open_store(path: str | os.PathLike, identity: Identity | None = None, *, max_bytes: int | None = None,
               chunk_tokens: int = 256, admin: bool = False, remote: Any = None, remote_prefix: str = "kvshelf:",
               remote_options: dict[str, Any] | None = None, **options: Any) -> Store:
    """Open (creating if needed) the store at ``path`` under ``identity`` (use as a context manager).

    ``admin=True`` without an identity opens it identity-blind for offline tools (see ``Store``); ``byte_store=``
    puts the packs in any ``ByteStore`` implementation, ``index_store=`` the index in any ``IndexStore``.
    ``remote`` (a ``redis://`` / ``rediss://`` / ``redis+cluster://`` URL or a list of cluster seed nodes) adds the
    shared tier (``kvshelf.store.remote``; ``remote_options`` go to ``RemoteTier`` and redis-py)."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise WrongArgumentType(f"open_store needs a str or os.PathLike store path, got {type(path).__name__}")
    if identity is None and not admin:
        raise WrongArgumentType("open_store needs identity=Identity(model_id, ...): snapshots are only reused for their model")
    store = Store(path, identity, max_bytes=max_bytes, chunk_tokens=chunk_tokens, admin=admin, **options)
    if remote is not None and not admin:
        from .remote.tier import attach

        try:
            attach(store, remote, prefix=remote_prefix, **dict(remote_options or {}))
        except BaseException:
            store.close()
            raise
    return store


def identity_key_of(manifest: Manifest) -> bytes:
    return keys.identity_key_of(manifest)


__all__ = ["Store", "StoreBusy", "open_store"]
