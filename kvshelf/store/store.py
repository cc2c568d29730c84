"""The session store façade: one directory, an index (LMDB) and a byte store (packs), opened under one identity.

``Store`` checks its arguments (``inputs``: the one place session ids, namespaces and tokens are checked), builds
its collaborators in order and delegates to them; it holds no logic of its own beyond that. The collaborators share
one ``StoreContext`` (``context.py``) and receive the other collaborators they call in their constructors:
``liveness`` (write transactions, remembered uses, reclaim, leases, removal, the save gate), ``space`` (full disk,
budget), ``integrity`` (quarantine, verify, gc, rebuild), ``save``, ``restore`` and ``admin`` (the offline tools'
surface, ``store.admin``).

Durability order: a save's pack (chunks + its manifest in the trailer) is fsynced and renamed, its directory fsynced,
then ONE LMDB write transaction indexes it. Objects that lost their last reference are unlinked only in a later
write transaction that re-checks the ledger and the live leases, so a crash leaves at most unreferenced packs (``gc``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from ..codecs import CodecProvider, default_provider
from ..errors import InvalidCacheState, KvShelfError, SnapshotNotFound, WrongArgumentType
from . import inputs
from .admin.index_swap import IndexSwap
from .admin.surface import StoreAdmin
from .context import StoreContext
from .identity import Identity, namespace_key
from .index.schema import Manifest
from .integrity.gc import Gc
from .integrity.legacy_v1 import seal_v1_manifests
from .index import bad_chunks
from .integrity.quarantine import Quarantine
from .integrity.good_copies import GoodCopies
from .integrity.repair import Repair
from .integrity.rebuild import Rebuild
from .integrity.verify import Verifier
from .index.protocol import IndexStore
from .liveness import open_lock as openlock
from .liveness.leases import Leases
from .liveness.open_lock import StoreBusy
from .liveness.reclaim import Reclaimer
from .liveness.removal import Removal
from .liveness.transactions import Transactions
from .prefix.hashing import BLOCK_TOKENS
from .prefix.explain import explain_miss
from .prefix.index_records import IndexRecords
from .prefix.search import LazyTokens, PrefixSearch
from .remote.maintenance import RemoteAdmin
from .remote.tier import RemoteTier
from .restore.reader import Reader
from .restore.snapshots import Snapshots
from .results import PrefixHit, Restored, RestoredBatch, SessionInfo, SnapshotInfo
from .save.background import BackgroundWriter
from .save.saver import Saver
from .space.budget import Budget
from .space.full_disk import FullDisk
from .space.pins import Pins
from .generations import GenerationCheckpoint, GenerationCheckpoints
from .prefix.hashing import tokens_array
from .index.keys import parent_of
from .save.checkpoints import CheckpointInfo, Checkpoints

# The offline tools' calls: ``store.admin.<name>``. The same names on ``Store`` forward there (kept for callers
# written before ``store.admin`` existed; new tools code calls ``store.admin``). ``stats``, ``verify``, ``gc`` and
# ``rebuild_index`` are user calls too: on ``Store`` they stay.
TOOL_CALLS = ("manifest", "iter_manifests", "chunk_info", "iter_chunks", "iter_packs", "chunk_location",
              "stored_objects", "orphans", "leased_hashes", "open_chunk", "summaries", "rebuild_report", "lease",
              "put_chunks", "rewrite_chunk", "repack", "replace_manifest", "replace_snapshot", "exclusive",
              "replace_index", "empty_index", "copy_index", "stats", "verify", "gc", "rebuild_index", "quarantined",
              "bad_chunks")


class Store:
    """One store directory opened under one ``Identity``. Thread-safe; several processes may open it at once.

    ``admin=True`` (with no identity) opens it identity-blind for offline tools (``identity_blind`` says so): the
    tools' calls work on every identity's snapshots, while the identity-scoped calls (save, restore, lookup,
    sessions, delete) refuse. ``store.admin`` is the tools' surface (``StoreAdmin``), on every handle.
    ``byte_store`` replaces the local directory of packs by any ``ByteStore`` and ``index_store`` the LMDB index by
    any ``IndexStore`` (``MemoryIndexStore``: a throwaway store); the store speaks only those two protocols. The
    directory still holds the locks (and, by default, both of them).
    """

    def __init__(self, path: str | os.PathLike, identity: Identity | None, *, max_bytes: int | None = None,
                 chunk_tokens: int = 256, verify: bool = True, provider: CodecProvider | None = None,
                 map_size: int = 64 << 30, max_pending_bytes: int = 2 << 30, lease_seconds: float = 600.0,
                 admin: bool = False, byte_store=None, index_store=None, clock=None):
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
        ctx, gate = StoreContext.open(path, identity, provider or default_provider, byte_store, index_store, map_size,
                                      chunk_tokens=chunk_tokens, verify_reads=verify, max_bytes=max_bytes,
                                      lease_seconds=lease_seconds, block=BLOCK_TOKENS)
        self._ctx, self._gate = ctx, gate
        self.root, self.identity, self.id_key, self.identity_blind = ctx.root, identity, ctx.id_key, admin
        self.bytes, self.removers, self.counters, self.block = ctx.bytes, ctx.removers, ctx.counters, ctx.block
        self.provider, self.chunk_tokens, self.max_bytes = ctx.provider, chunk_tokens, max_bytes
        self.verify_reads, self.lease_seconds = verify, lease_seconds
        self._reclaimer = reclaimer = Reclaimer(ctx)
        self._txns = txns = Transactions(ctx, reclaimer)
        self._leases = leases = Leases(ctx, reclaimer, txns.uses)
        self.pins = pins = Pins(ctx, clock)  # clock: seconds (time.time); tests check pins' TTLs with a fake one
        # a session's checkpoints (save/checkpoints.py): saved as derived snapshots, dropped with their session
        self.checkpoints = checkpoints = Checkpoints(lambda: ctx.index, self._session_key, self._save_derived,
                                                     lambda *a: self._saver.capture(*a),
                                                     lambda cap: self._published(self._saver.write(cap)))
        self._removal = removal = Removal(ctx, reclaimer, followers=(pins, checkpoints))
        self._writer = writer = BackgroundWriter(max_pending_bytes)
        gc = Gc(ctx, gate, txns, reclaimer)
        self._full_disk = full_disk = FullDisk(ctx, txns, removal, gc)  # sizes and takes the reserve from the index
        self._quarantine = quarantine = Quarantine(ctx, txns, full_disk, removal)
        self._snapshots = snapshots = Snapshots(ctx)
        self._reader = Reader(ctx, leases, snapshots, quarantine)
        self._saver = saver = Saver(ctx, gate, txns, reclaimer, Budget(ctx, txns, reclaimer, removal, pins))
        swap = IndexSwap(ctx, gate, txns, writer.flush)
        verifier = Verifier(ctx, gate, reclaimer)
        self.admin = StoreAdmin(ctx, snapshots=snapshots, leases=leases, reclaimer=reclaimer, txns=txns, gate=gate,
                                saver=saver, writer=writer, verifier=verifier, gc=gc,
                                rebuild=Rebuild(ctx, swap), swap=swap, pins=pins)
        self._repair = Repair(ctx, txns, removal, quarantine, verifier, gc,
                              GoodCopies(ctx, txns, gate, reclaimer, saver.write_pack),
                              rewrite_packs=lambda packs: self.admin.repack(packs=packs))
        if not ctx.read_only:  # once per index: v1 manifest files get the checksum rebuilds need
            seal_v1_manifests(ctx.index, ctx.bytes)

    # the context's fields that change after open: read through, never copied
    index = property(lambda self: self._ctx.index, lambda self, v: setattr(self._ctx, "index", v))
    tier = property(lambda self: self._ctx.tier, lambda self, v: setattr(self._ctx, "tier", v))  # remote/, or None
    leases = property(lambda self: self._ctx.leases, lambda self, v: setattr(self._ctx, "leases", v))

    @property
    def read_only(self) -> bool:
        """True when this process may not write the store (store/access.py): reads work, writes raise
        ``StoreReadOnly``. Decided at open; the store's permissions are never changed by an open."""
        return self._ctx.read_only

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for queued async saves (errors are not raised here: call ``flush`` first), then close the index."""
        if self._ctx.closed:
            return
        self._writer.close()
        if self.tier is not None:  # after queued saves: they publish too
            self.tier.close()
        try:
            self._txns.close()  # remembered uses are written
        finally:
            self._ctx.closed = True
            self.leases.close()
            self.index.close()
            openlock.release(self._ctx.lock_key)

    def _check_scoped(self, what: str) -> None:
        self._ctx.check_open()
        if self.id_key is None:
            raise KvShelfError(f"{what} needs a model identity: this handle on {self.root} was opened identity-blind "
                               f"(admin=True) for offline tools")

    def save_gate(self, exclusive: bool = False, timeout: float = 30.0):
        """The store-wide save gate (``liveness/save_gate.py``): saves hold it shared from their first write to their
        commit; orphan sweeps and offline jobs hold it exclusively. ``StoreBusy`` after ``timeout`` seconds."""
        return self._gate.hold(exclusive, timeout)

    # ------------------------------------------------------------------ saving
    def save(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "",
             checkpoints: dict[int, Sequence[Any]] | None = None) -> SnapshotInfo:
        """Persist the caches for ``tokens`` as the session's latest snapshot (only new chunks are written).
        ``checkpoints={k: caches_at_k}`` also saves the state after ``tokens[:k]`` (docs/CHECKPOINTS.md)."""
        self._ctx.check_writable("save")
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self._check_scoped("save")
        if checkpoints:
            self.checkpoints.ordered(tokens_array(tokens), checkpoints)  # refused before anything is written
        info = self._published(self._saver.write(self._saver.capture(session_id, tokens, caches, namespace)))
        if checkpoints:  # after the session, so they share its chunks
            self.checkpoints.save_many(session_id, tokens_array(tokens), checkpoints, namespace)
        return info

    def save_async(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any],
                   namespace: str = "", checkpoints: dict[int, Sequence[Any]] | None = None) -> Future:
        """Snapshot and evaluate now, write in the background; ``flush()`` waits and re-raises failures.
        ``checkpoints`` as in ``save``: captured now too, written right after the session."""
        self._ctx.check_writable("save_async")
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self._check_scoped("save_async")
        cap = self._saver.capture(session_id, tokens, caches, namespace)
        if not checkpoints:
            return self._writer.submit(lambda: self._published(self._saver.write(cap)), cap.nbytes)
        ckpts = self.checkpoints.capture_many(session_id, tokens_array(tokens), checkpoints, namespace)

        def write_all() -> SnapshotInfo:  # the session first: its checkpoints share its chunks and need it
            info = self._published(self._saver.write(cap))
            self.checkpoints.write_captured(session_id, namespace, ckpts)
            return info

        return self._writer.submit(write_all, cap.nbytes + sum(c.nbytes for c in ckpts))

    def save_checkpoint(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any],
                        namespace: str = "") -> SnapshotInfo:
        """Save ``caches`` (the state after ``tokens`` = the session's first k tokens) as a checkpoint of the
        existing session at k: lookups reuse it for prompts that match those k tokens (docs/CHECKPOINTS.md)."""
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self._check_scoped("save_checkpoint")
        self._ctx.check_writable("save_checkpoint")
        return self.checkpoints.save(session_id, tokens, caches, namespace)

    def list_checkpoints(self, session_id: str, namespace: str = "") -> list[CheckpointInfo]:
        """The session's checkpoints (``CheckpointInfo``: length, snapshot id, bytes referenced), by length."""
        inputs.check_session(session_id, namespace)
        self._check_scoped("list_checkpoints")
        return self.checkpoints.listed(session_id, namespace)

    def _save_derived(self, derived_id: str, tokens, caches: Sequence[Any], namespace: str) -> SnapshotInfo:
        return self._published(self._saver.write(self._saver.capture(derived_id, tokens, caches, namespace)))

    def _published(self, info: SnapshotInfo) -> SnapshotInfo:
        """Local-durable first; then the reserve grows with the longest snapshot (a delete of it must fit on a full
        disk); then the shared tier (if any) queues it for publishing, never waiting."""
        self._full_disk.keep_reserve(info.length)
        if self.tier is not None:
            try:
                self.tier.saved(self._snapshots.manifest(info.snapshot_id))
            except SnapshotNotFound:  # already evicted or replaced: nothing to publish
                pass
        return info

    def flush(self) -> None:
        self._writer.flush()

    # ------------------------------------------------------------------ lookup and restore
    def lookup(self, prompt_tokens: Sequence[int], namespace: str = "") -> PrefixHit | None:
        """The longest usable stored prefix of the prompt, or None. Reads no chunks.

        A list prompt is converted (and checked) only as far as the lookup reads it, so a miss costs microseconds
        however long the prompt; arrays are converted whole (that is cheap)."""
        prompt_tokens, _ = inputs.check_prompt(prompt_tokens), inputs.check_namespace(namespace)
        self._check_scoped("lookup")
        prompt = LazyTokens(prompt_tokens, "prompt_tokens")
        nsk = self._ns_key(namespace)
        self.counters.lookups += 1
        with self.index.read() as txn:
            found = PrefixSearch(IndexRecords(txn, self._touched()), nsk, prompt, self.block).run()
            if found is not None and bad_chunks.uses_bad(txn, found.sid, found.length):
                found = None  # it would fail its restore: a miss, so the caller's next save heals the copy
        hit = None if found is None else PrefixHit(found.summary.session_id, found.sid.hex(), found.length,
                                                   found.summary.namespace, found.summary.length)
        if self.tier is not None:  # local first; the shared tier only when it gives a longer prefix
            hit = self.tier.lookup(prompt, namespace, hit)
        parent = None if hit is None else parent_of(hit.session_id)
        if parent is not None:  # a checkpoint (save/checkpoints.py): reported as its session's
            hit = PrefixHit(parent[0], hit.snapshot_id, hit.length, hit.namespace, hit.snapshot_length, True)
        if hit is not None:
            self.counters.hits += 1
        return hit

    def explain_miss(self, prompt_tokens: Sequence[int], namespace: str = "") -> str:
        """Why ``lookup`` finds no usable prefix of the prompt: ``"nothing_stored"``, ``"other_identity"`` (a stored
        prefix of another model identity), ``"below_floor"`` (shorter than the snapshot's minimum_reusable_offset) or
        ``"not_exact_length"`` (recurrent or rotating state, and the prompt diverges before its end). Call it on a
        miss only: it searches again without the usability rules (``prefix/explain.py``)."""
        prompt_tokens, _ = inputs.check_prompt(prompt_tokens), inputs.check_namespace(namespace)
        self._check_scoped("explain_miss")
        with self.index.read() as txn:
            return explain_miss(txn, self.id_key, namespace, LazyTokens(prompt_tokens, "prompt_tokens"), self.block)

    def restore(self, session_id: str, namespace: str = "") -> Restored:
        """The session's latest snapshot, whole."""
        inputs.check_session(session_id, namespace)
        self._check_scoped("restore")
        return self._reader.restore(session_id, namespace)

    def restore_snapshot(self, snapshot_id: str, length: int | None = None) -> Restored:
        """A snapshot by id (cut to ``length`` if given); another identity's snapshot raises ``IdentityMismatch``."""
        snapshot_id, length = inputs.check_snapshot_id(snapshot_id), inputs.check_length(length)
        self._check_scoped("restore_snapshot")
        return self._reader.restore_snapshot(snapshot_id, length)

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

    def restore_batch(self, requests: Sequence[str | PrefixHit | tuple[str, str]]) -> RestoredBatch:
        """Several rows restored straight into one batched cache per layer, rows in request order."""
        inputs.check_requests(requests)
        self._check_scoped("restore_batch")
        return self._reader.restore_batch(requests)

    # ------------------------------------------------------------------ management
    def delete(self, session_id: str, namespace: str = "") -> None:
        """Remove the session's snapshot; chunks no other snapshot references are freed."""
        self._ctx.check_writable("delete")
        inputs.check_session(session_id, namespace)
        self._check_scoped("delete")
        skey = self._session_key(session_id, namespace)
        self._full_disk.delete(skey, session_id, namespace,
                               also=lambda txn: Checkpoints.drop_quarantined(txn, skey))  # its checkpoints' records too

    # ------------------------------------------------------------------ pins (space/pins.py)
    def pin(self, session_id: str, namespace: str = "", ttl: float | None = None):
        """Never evict the session (budget, LRU) until ``unpin`` or ``ttl`` seconds after its last use."""
        self._ctx.check_writable("pin")
        inputs.check_session(session_id, namespace)
        self._ctx.check_open()
        return self.pins.pin(session_id, namespace, ttl)

    def unpin(self, session_id: str, namespace: str = "") -> bool:
        """Drop the session's pin (False when it had none); the budget may evict it again."""
        self._ctx.check_writable("unpin")
        inputs.check_session(session_id, namespace)
        self._ctx.check_open()
        return self.pins.unpin(session_id, namespace)

    def sessions(self, namespace: str | None = None) -> list[SessionInfo]:
        """This identity's sessions (all namespaces when ``namespace`` is None), most recently used first."""
        inputs.check_optional_namespace(namespace)
        self._check_scoped("sessions")
        return self._snapshots.sessions(namespace, self._touched())

    def quarantine(self, snapshot_id: str, reason: str) -> None:
        """Hide a snapshot for good, keeping its objects as evidence (``integrity/quarantine.py``)."""
        self._quarantine.quarantine(snapshot_id, reason)

    def repair(self, dry_run: bool = True, remote: Any = None, remote_prefix: str = "kvshelf:"):
        """Rewrite what has a good copy (a damaged chunk from another pack or the shared tier, damaged pack trailers
        from the index), drop what cannot be read (snapshots using a chunk with no good copy, quarantined
        snapshots), reclaim the space: a ``RepairReport`` of what was done and lost (``integrity/repair.py``).
        ``dry_run`` changes nothing. ``remote``: a shared tier (URL or seed list, as ``open_store``) to take good
        copies from; default: the tier this handle was opened with, if any. Identity-blind."""
        self._ctx.check_open()
        if remote is None:
            return self._repair.repair(dry_run, self._ctx.tier)
        with RemoteAdmin(remote, prefix=remote_prefix) as tier:
            return self._repair.repair(dry_run, tier)

    def drop_quarantined(self, snapshot_id: str) -> bool:
        """An operator's decision: forget a quarantined snapshot (identity-blind). True when a record was dropped."""
        self._ctx.check_writable("drop_quarantined")
        self._ctx.check_open()
        return self._quarantine.drop_quarantined(snapshot_id)

    # ------------------------------------------------------------------ generation checkpoints (generations.py)
    def save_generation_checkpoint(self, key: str, tokens: Sequence[int], caches: Sequence[Any], *,
                                   prompt_length: int, pending_token: int, sampler_state: bytes | None,
                                   background: bool = False):
        """A checkpoint of an in-flight generation under continuation ``key`` (see ``generations.py``)."""
        return GenerationCheckpoints(self).save(key, tokens, caches, prompt_length=prompt_length,
                                                pending_token=pending_token, sampler_state=sampler_state,
                                                background=background)

    def find_generation_checkpoint(self, key: str, prompt_tokens: Sequence[int]) -> GenerationCheckpoint | None:
        """The longest checkpoint of ``key`` for exactly this prompt, restored, or None."""
        return GenerationCheckpoints(self).find(key, prompt_tokens)

    def drop_generation_checkpoints(self, key: str) -> int:
        """Delete every checkpoint of ``key`` (its generation completed); how many there were."""
        return GenerationCheckpoints(self).drop(key)

    # ------------------------------------------------------------------ private forwards (tests)
    def _touched(self) -> dict[bytes, int]:
        return self._txns.uses.touched()

    def _ns_key(self, namespace: str) -> bytes:
        self._check_scoped("a namespaced call")
        return namespace_key(self.id_key, inputs.check_namespace(namespace))

    def _session_key(self, session_id: str, namespace: str) -> bytes:
        self._check_scoped("a session call")
        return self._snapshots.session_key(session_id, namespace)

    def _lease(self, manifest: Manifest, refs, with_where: bool = False):
        return self._leases.take(manifest, refs, with_where)

    def _release(self, key: bytes, touch: bytes | None, refs) -> None:
        self._leases.release(key, touch, refs)

    def _read_arrays(self, manifest: Manifest, p: int, direct: bool = False):
        return self._reader.read_arrays(manifest, p, direct)


def _tool_call(name: str):
    @functools.wraps(getattr(StoreAdmin, name))
    def forward(self, *args, **kwargs):
        return getattr(self.admin, name)(*args, **kwargs)

    forward.__doc__ = f"Forwards to ``store.admin.{name}``: {forward.__doc__ or ''}"
    return forward


for _name in TOOL_CALLS:
    setattr(Store, _name, _tool_call(_name))
# the names before the store said "chunk" for one thing, kept as forwards for callers written then
for _old, _name in (("open_blob", "open_chunk"), ("put_blobs", "put_chunks"), ("rewrite_blob", "rewrite_chunk")):
    setattr(Store, _old, _tool_call(_name))


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
        try:
            RemoteTier(remote, prefix=remote_prefix, **dict(remote_options or {})).bind(
                store._ctx, store._snapshots, store.admin.lease, store.save)
        except BaseException:
            store.close()
            raise
    return store


__all__ = ["Store", "StoreBusy", "open_store"]
