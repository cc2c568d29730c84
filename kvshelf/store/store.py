"""The session store façade: one directory, an index (LMDB) and a byte store (packs), opened under one identity.

Why a façade that only delegates: a reader following ``Store.save`` or ``Store.restore_prefix`` should land, in one
step, in the room that does the work. So this module holds the public calls and their contracts (docstrings) and
nothing else: the arguments are checked by the collaborator each call delegates to (``store/inputs.py`` is the one
place ids, namespaces and tokens are checked), opening is ``opening.py``, the wiring ``assembly.py``, and the
offline tools' calls live on ``store.admin`` (``admin/surface.py``).

Durability order: a save's pack (chunks + its manifest in the trailer) is fsynced and renamed, its directory fsynced,
then ONE LMDB write transaction indexes it. Objects that lost their last reference are unlinked only in a later
write transaction that re-checks the ledger and the live leases, so a crash leaves at most unreferenced packs (``gc``).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from ..codecs import CodecProvider, default_provider
from ..errors import InvalidCacheState, KvShelfError, WrongArgumentType
from .assembly import assemble, bind_remote
from .generations import GenerationCheckpoint, GenerationCheckpoints
from .identity import Identity
from .identity import tenant_namespace as scope  # ``tenant=``: the tenant is part of the namespace, so of every key
from .index.protocol import IndexStore
from .liveness.open_lock import StoreBusy
from .opening import open_context
from .prefix.hashing import BLOCK_TOKENS
from .results import PrefixHit, Restored, RestoredBatch, SessionInfo, SnapshotInfo
from .save.checkpoints import CheckpointInfo
from .space.budget import tenant_limits

log = logging.getLogger("kvshelf.store")

# Names that were ``Store`` methods before the offline tools' calls moved to ``store.admin`` (and before "blob"
# became "chunk"): deprecated, kept for one release, each warning and answering with the ``store.admin`` call.
DEPRECATED_TOOL_CALLS = {name: name for name in (
    "manifest", "iter_manifests", "chunk_info", "iter_chunks", "iter_packs", "chunk_location", "stored_objects",
    "orphans", "leased_hashes", "open_chunk", "summaries", "rebuild_report", "lease", "put_chunks", "rewrite_chunk",
    "repack", "replace_manifest", "replace_snapshot", "exclusive", "replace_index", "empty_index", "copy_index",
    "quarantined", "bad_chunks")} | {"open_blob": "open_chunk", "put_blobs": "put_chunks", "rewrite_blob": "rewrite_chunk"}


class Store:
    """One store directory opened under one ``Identity``. Thread-safe; several processes may open it at once.

    ``admin=True`` (with no identity) opens it identity-blind for offline tools (``identity_blind`` says so): the
    tools' calls work on every identity's snapshots, while the identity-scoped calls (save, restore, lookup,
    sessions, delete) refuse. ``store.admin`` is the tools' surface (``StoreAdmin``), on every handle.
    ``byte_store`` replaces the local directory of packs by any ``ByteStore`` and ``index_store`` the LMDB index by
    any ``IndexStore`` (``MemoryIndexStore``: a throwaway store); the store speaks only those two protocols. The
    directory still holds the locks (and, by default, both of them). ``clock`` (seconds, like ``time.time``) is
    what pin expiry reads: a test advances its own instead of sleeping. ``tenant_max_bytes`` (an int for every tenant, or
    ``{tenant: bytes}``) is each tenant's quota (``set_tenant_limit``). ``key`` (32 bytes, or a passphrase str)
    encrypts chunks at rest, per tenant (``objects/sealing.py``; docs/API.md, "Encryption at rest").
    """

    def __init__(self, path: str | os.PathLike, identity: Identity | None, *, max_bytes: int | None = None,
                 chunk_tokens: int = 256, verify: bool = True, provider: CodecProvider | None = None,
                 map_size: int = 64 << 30, max_pending_bytes: int = 2 << 30, lease_seconds: float = 600.0,
                 admin: bool = False, byte_store=None, index_store=None, clock=None, tenant_max_bytes=None,
                 key: bytes | str | None = None):
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
        ctx, gate = open_context(path, identity, provider or default_provider, byte_store, index_store, map_size,
                                 chunk_tokens=chunk_tokens, verify_reads=verify, max_bytes=max_bytes,
                                 lease_seconds=lease_seconds, block=BLOCK_TOKENS,
                                 tenant_max_bytes=tenant_limits(tenant_max_bytes), key=key)
        self._parts = parts = assemble(ctx, gate, max_pending_bytes=max_pending_bytes, clock=clock)
        self._ctx, self._generations = ctx, GenerationCheckpoints(self)
        self.root, self.identity, self.id_key, self.identity_blind = ctx.root, identity, ctx.id_key, admin
        self.bytes, self.removers, self.counters, self.block = ctx.bytes, ctx.removers, ctx.counters, ctx.block
        self.provider, self.chunk_tokens, self.max_bytes = ctx.provider, chunk_tokens, max_bytes
        self.verify_reads, self.lease_seconds = verify, lease_seconds
        self.admin, self.pins, self.checkpoints = parts.admin, parts.pins, parts.checkpoints
        if not admin and not ctx.read_only:
            try:  # a tenant left over its quota by a killed writer (space/budget.py): evicted now, not at its next save
                parts.budget.enforce_tenants()
            except KvShelfError as exc:  # the store still opens; the tenant's next save evicts again
                log.warning("kvshelf store %s: could not enforce the tenant quotas at open: %s", ctx.root, exc)

    # the context's fields that change after open: read through, never copied
    index = property(lambda self: self._ctx.index, doc="the index (``IndexStore``); an index swap replaces it")
    tier = property(lambda self: self._ctx.tier, doc="the shared tier (``remote/tier.py``), or None")

    @property
    def leases(self):
        """Every handle's lease files (``liveness/lease_files.py``); a test replaces them to lose a reader's."""
        return self._ctx.leases

    @leases.setter
    def leases(self, book) -> None:
        self._ctx.leases = book

    @property
    def read_only(self) -> bool:
        """True when this process may not write the store (``liveness/access.py``): reads work, writes raise
        ``StoreReadOnly``. Decided at open; the store's permissions are never changed by an open."""
        return self._ctx.read_only

    def __getattr__(self, name: str):
        """The deprecated tool calls (``DEPRECATED_TOOL_CALLS``): a warning, then ``store.admin``'s call."""
        if name not in DEPRECATED_TOOL_CALLS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        new = DEPRECATED_TOOL_CALLS[name]
        warnings.warn(f"Store.{name} is deprecated: call store.admin.{new}", DeprecationWarning, stacklevel=2)
        return getattr(self.__dict__["admin"], new)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for queued async saves (errors are not raised here: call ``flush`` first), then close the index."""
        self._parts.close()

    def save_gate(self, exclusive: bool = False, timeout: float = 30.0):
        """The store-wide save gate (``liveness/save_gate.py``): saves hold it shared from their first write to their
        commit; orphan sweeps and offline jobs hold it exclusively. ``StoreBusy`` after ``timeout`` seconds."""
        return self._parts.gate.hold(exclusive, timeout)

    # ------------------------------------------------------------------ saving (save/session_saves.py)
    def save(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "",
             checkpoints: dict[int, Sequence[Any]] | None = None, *, tenant: str = "") -> SnapshotInfo:
        """Persist the caches for ``tokens`` as the session's latest snapshot (only new chunks are written).
        ``checkpoints={k: caches_at_k}`` also saves the state after ``tokens[:k]`` (docs/CHECKPOINTS.md)."""
        return self._parts.saves.save(session_id, tokens, caches, scope(namespace, tenant), checkpoints)

    def save_async(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any],
                   namespace: str = "", checkpoints: dict[int, Sequence[Any]] | None = None, *,
                   tenant: str = "") -> Future:
        """Snapshot and evaluate now, write in the background; ``flush()`` waits and re-raises failures.
        ``checkpoints`` as in ``save``: captured now too, written right after the session."""
        return self._parts.saves.save_async(session_id, tokens, caches, scope(namespace, tenant), checkpoints)

    def save_checkpoint(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any],
                        namespace: str = "", *, tenant: str = "") -> SnapshotInfo:
        """Save ``caches`` (the state after ``tokens`` = the session's first k tokens) as a prefix checkpoint of the
        existing session at k: lookups reuse it for prompts that match those k tokens (docs/CHECKPOINTS.md)."""
        return self._parts.saves.save_checkpoint(session_id, tokens, caches, scope(namespace, tenant))

    def list_checkpoints(self, session_id: str, namespace: str = "", *, tenant: str = "") -> list[CheckpointInfo]:
        """The session's prefix checkpoints (``CheckpointInfo``: length, snapshot id, bytes referenced), by length."""
        return self._parts.saves.list_checkpoints(session_id, scope(namespace, tenant))

    def flush(self) -> None:
        """Wait for every queued ``save_async``; re-raise the first failure."""
        self._parts.saves.flush()

    # ------------------------------------------------------------------ lookup (prefix/lookups.py)
    def lookup(self, prompt_tokens: Sequence[int], namespace: str = "", *, tenant: str = "") -> PrefixHit | None:
        """The longest usable stored prefix of the prompt, or None. Reads no chunks. A list prompt is converted (and
        checked) only as far as the lookup reads it, so a miss costs microseconds however long the prompt."""
        return self._parts.lookups.lookup(prompt_tokens, scope(namespace, tenant))

    def explain_miss(self, prompt_tokens: Sequence[int], namespace: str = "", *, tenant: str = "") -> str:
        """Why ``lookup`` finds no usable prefix of the prompt: ``"nothing_stored"``, ``"other_identity"`` (a stored
        prefix of another model identity), ``"below_floor"`` (shorter than the snapshot's minimum_reusable_offset) or
        ``"not_exact_length"`` (recurrent or rotating state, and the prompt diverges before its end). Call it on a
        miss only: it searches again without the usability rules (``prefix/explain.py``)."""
        return self._parts.lookups.explain_miss(prompt_tokens, scope(namespace, tenant))

    # ------------------------------------------------------------------ restoring (restore/restores.py)
    def restore(self, session_id: str, namespace: str = "", *, tenant: str = "") -> Restored:
        """The session's latest snapshot, whole."""
        return self._parts.restores.restore(session_id, scope(namespace, tenant))

    def restore_snapshot(self, snapshot_id: str, length: int | None = None) -> Restored:
        """A snapshot by id (cut to ``length`` if given); another identity's snapshot raises ``IdentityMismatch``."""
        return self._parts.restores.restore_snapshot(snapshot_id, length)

    def restore_prefix(self, prompt_tokens: Sequence[int], namespace: str = "", *,
                       tenant: str = "") -> Restored | None:
        """Caches for the longest usable stored prefix of the prompt (reading only the chunks covering it)."""
        return self._parts.restores.restore_prefix(prompt_tokens, scope(namespace, tenant))

    def restore_batch(self, requests: Sequence[str | PrefixHit | tuple[str, str]]) -> RestoredBatch:
        """Several rows restored straight into one batched cache per layer, rows in request order."""
        return self._parts.restores.restore_batch(requests)

    def sessions(self, namespace: str | None = None, *, tenant: str | None = None) -> list[SessionInfo]:
        """This identity's sessions (all namespaces when ``namespace`` is None), most recently used first; with
        ``tenant``, only that tenant's (its every namespace when ``namespace`` is None)."""
        return self._parts.restores.sessions(namespace, tenant)

    # ------------------------------------------------------------------ what is kept (space/keeping.py)
    def delete(self, session_id: str, namespace: str = "", *, tenant: str = "") -> None:
        """Remove the session's snapshot; chunks no other snapshot references are freed."""
        self._parts.keeping.delete(session_id, scope(namespace, tenant))

    def pin(self, session_id: str, namespace: str = "", ttl: float | None = None, *, tenant: str = ""):
        """Never evict the session (budget, LRU) until ``unpin`` or ``ttl`` seconds after its last use."""
        return self._parts.keeping.pin(session_id, scope(namespace, tenant), ttl)

    def unpin(self, session_id: str, namespace: str = "", *, tenant: str = "") -> bool:
        """Drop the session's pin (False when it had none); the budget may evict it again."""
        return self._parts.keeping.unpin(session_id, scope(namespace, tenant))

    def set_tenant_limit(self, tenant: str, max_bytes: int | None) -> None:
        """``tenant``'s quota (``"*"``: every tenant's default; None drops it): over it, the tenant's own LRU
        unpinned sessions are evicted after its saves, never another tenant's (``space/budget.py``)."""
        self._parts.budget.set_tenant_limit(tenant, max_bytes)

    def forget_tenant(self, tenant: str) -> dict[str, int]:
        """Remove every snapshot, checkpoint, pin and shared-tier entry of ``tenant`` (every identity; with encryption
        its data key first): counts of what went. Chunks left unreferenced are ``gc``'s (``admin/forget.py``)."""
        return self._parts.forget.forget(tenant)

    # ------------------------------------------------------------------ integrity (integrity/, admin/surface.py)
    def stats(self) -> dict[str, Any]:
        """Totals, deduplication, budget, chunk and orphan counts, and this handle's counters."""
        return self.admin.stats()

    def verify(self, deep: bool = False):
        """Check the store; ``deep`` re-hashes every chunk. A list of ``Finding`` (empty: clean)."""
        return self.admin.verify(deep)

    def gc(self, dry_run: bool = True):
        """Remove orphans and unreferenced chunks (``GcReport``); a dry run only reports."""
        return self.admin.gc(dry_run)

    def rebuild_index(self) -> int:
        """Rebuild the index from the packs alone; how many snapshots it indexed (``admin.rebuild_report()``)."""
        return self.admin.rebuild_index()

    def quarantine(self, snapshot_id: str, reason: str) -> None:
        """Hide a snapshot for good, keeping its objects as evidence (``integrity/quarantine.py``)."""
        self._parts.quarantine.quarantine(snapshot_id, reason)

    def drop_quarantined(self, snapshot_id: str) -> bool:
        """An operator's decision: forget a quarantined snapshot (identity-blind). True when a record was dropped."""
        return self._parts.quarantine.drop_quarantined(snapshot_id)

    def repair(self, dry_run: bool = True, remote: Any = None, remote_prefix: str = "kvshelf:"):
        """Rewrite what has a good copy (a damaged chunk from another pack or the shared tier, damaged pack trailers
        from the index), drop what cannot be read (snapshots using a chunk with no good copy, quarantined
        snapshots), reclaim the space: a ``RepairReport`` of what was done and lost (``integrity/repair.py``).
        ``dry_run`` changes nothing. ``remote``: a shared tier (URL or seed list, as ``open_store``) to take good
        copies from; default: the tier this handle was opened with, if any. Identity-blind."""
        return self._parts.repair.repair_from(dry_run, remote, remote_prefix)

    # ------------------------------------------------------------------ generation checkpoints (generations/)
    def save_generation_checkpoint(self, key: str, tokens: Sequence[int], caches: Sequence[Any], *,
                                   prompt_length: int, pending_token: int, sampler_state: bytes | None,
                                   background: bool = False, tenant: str = ""):
        """A checkpoint of an in-flight generation under continuation ``key`` (docs/RESUMING.md)."""
        return self._generations.save(key, tokens, caches, prompt_length=prompt_length, pending_token=pending_token,
                                      sampler_state=sampler_state, background=background, tenant=tenant)

    def find_generation_checkpoint(self, key: str, prompt_tokens: Sequence[int], *,
                                   tenant: str = "") -> GenerationCheckpoint | None:
        """The longest generation checkpoint of ``key`` for exactly this prompt, restored, or None."""
        return self._generations.find(key, prompt_tokens, tenant)

    def drop_generation_checkpoints(self, key: str, *, tenant: str = "") -> int:
        """Delete every generation checkpoint of ``key`` (its generation completed); how many there were."""
        return self._generations.drop(key, tenant)


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
            bind_remote(store._parts, remote, remote_prefix, dict(remote_options or {}))
        except BaseException:
            store.close()
            raise
    return store


__all__ = ["Store", "StoreBusy", "open_store"]
