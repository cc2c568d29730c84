"""``RemoteTier``: the shared tier a local store publishes to and falls back on (chunks + prefix index on Redis).

* publish (write-behind): ``saved(manifest)`` is called by the store after a save committed locally; it only puts
  the manifest on a bounded queue (full → dropped and counted), so a save never waits for the network. One thread
  uploads the chunks the server lacks (read back from the local store under a lease: the same bytes and hashes) and
  then commits the index entry (summary, tokens, manifest, boundary records, session pointer) in ONE
  ``MULTI``/``EXEC``, so no host ever sees half an entry. A marker key with a TTL says a publish is in progress
  (``gc`` waits for it; a publisher does not start while a ``gc`` marker exists).
* lookup: after the local lookup, if the local hit does not already cover the prompt; the remote hit is used only
  when strictly longer. Token-verified (``index/lmdb_env.py``).
* restore: the manifest, then the chunks covering the cut, pipelined (``GET`` in batches of ``fetch_batch_bytes``),
  every chunk verified by its hash before it is used. A missing chunk (evicted, flushed) → a miss; a corrupt or
  truncated one → counted, deleted, the index entry dropped, a miss. A remote hit may be kept locally
  (``keep_local``: saved into the local store as session ``remote/<snapshot id>``, not published again).
* faults: every call has bounded socket timeouts; failures feed a ``CircuitBreaker`` that short-circuits to a miss
  while open. A remote failure never raises out of a lookup, and out of a restore only as ``SnapshotNotFound``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ...errors import CorruptData, IncompatibleFormat, KvShelfError, SnapshotNotFound, StoreFull
from ..base import seams
from ..context import StoreContext
from ..index import schema
from ..objects.protocol import BackendUnavailable
from ..identity import namespace_key
from ..prefix.search import LazyTokens, PrefixSearch
from ..index.schema import Manifest
from ..restore.snapshots import Snapshots
from ..results import PrefixHit, Restored
from ..save import QUEUED, BackgroundWriter, WriteBehindQueue
from . import fetch, local
from .breaker import CircuitBreaker
from .bytestore import RedisByteStore
from .client import DEFAULT_PREFIX, check_prefix, connect, redact
from .errors import translate
from .search import RedisRecords, boundary_members
from .keys import Keys
from .fetch import Missing as _Missing
from .fetch import NotOurs as _NotOurs
from .records import (
    RemoteSummary,
    decode_tokens,
    encode_summary,
    encode_tokens,
    seal,
    unseal,
)

log = logging.getLogger("kvshelf.store")

IMPORTED = "remote/"          # local session id prefix of remote hits kept locally (never published again)
MARKER_MS = 120_000           # a publish-in-progress marker outlives a crashed publisher by this much at most
_REMOTE_ERRORS = (BackendUnavailable, StoreFull)


class RemoteTier:
    def __init__(self, remote, *, prefix: str = DEFAULT_PREFIX, queue_size: int = 64, keep_local: bool = True,
                 fetch_batch_bytes: int = 32 << 20, breaker: CircuitBreaker | None = None, direct_reads: bool = True,
                 close_timeout: float = 10.0, **client_options: Any):
        self.where = redact(remote)
        self.client = connect(remote, **client_options)
        self.prefix = check_prefix(prefix)
        self.keys = Keys(self.prefix)
        self.chunks = RedisByteStore(self.client, prefix=self.prefix)
        self.keep_local, self.fetch_batch_bytes, self.close_timeout = keep_local, fetch_batch_bytes, close_timeout
        self.direct = direct_reads
        self.breaker = breaker or CircuitBreaker()
        if self.breaker.on_change is None:  # one WARNING when an outage starts, one when it ends
            self.breaker.on_change = self._breaker_changed
        self._outage_since: float | None = None
        self.host = f"{socket.gethostname()}:{os.getpid()}"
        self.ctx = self.snapshots = self._lease = self._save = None  # the local store's, given by bind()
        # publishing is write-behind: the one queue every such writer composes (save/write_behind.py), its worker a
        # BackgroundWriter of the tier's own (one thread); the bound is the queue's, in entries
        self._publishes = WriteBehindQueue(max_entries=queue_size)
        self._publisher = BackgroundWriter(max_pending_bytes=queue_size + 1)  # never blocks: the queue bounds it
        self._closed = False
        self._memo: OrderedDict[str, tuple[bytes, str]] = OrderedDict()  # remote hit sid -> (nsk, namespace)
        self._memo_lock = threading.Lock()
        self._unloadable: set[bytes] = set()  # remote snapshots of a provider or kind this host lacks
        self.counters = {k: 0 for k in (
            "published", "publish_dropped", "publish_failed", "publish_skipped", "chunks_uploaded",
            "bytes_uploaded", "chunks_present", "lookups", "hits", "misses", "lookup_errors", "restores",
            "restore_misses", "chunks_fetched", "bytes_fetched", "corrupt_chunks", "missing_chunks",
            "dropped_entries", "kept_local", "keep_local_failed", "restore_errors")}

    # ------------------------------------------------------------------ wiring
    def bind(self, ctx: StoreContext, snapshots: Snapshots, lease: Callable, save: Callable) -> RemoteTier:
        """Wire the tier to one local store handle: its context, its manifests, ``lease`` (``store.admin.lease``:
        the publisher reads chunks back under a lease) and ``save`` (``Store.save``: a remote hit kept locally)."""
        self.ctx, self.snapshots, self._lease, self._save = ctx, snapshots, lease, save
        ctx.tier = self
        return self

    def close(self) -> None:
        """Publish what is queued (waiting at most ``close_timeout`` seconds), then stop and disconnect: what could
        not be published in time is dropped (and counted) when its turn comes, never waited for."""
        if self._closed:
            return
        self._publishes.close(self.close_timeout)
        self._closed = True
        self._publisher.close(self.close_timeout)
        self.client.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued publish finished (True) or ``timeout`` passed (False)."""
        return self._publishes.flush(timeout)

    # ------------------------------------------------------------------ publish (write-behind)
    def saved(self, manifest: Manifest) -> None:
        """Called by the store after a save committed locally: queue it, never wait (full queue → dropped)."""
        if self._closed or manifest.session_id.startswith(IMPORTED):
            return
        said = self._publishes.submit(manifest.snapshot_id, 1,
                                      lambda: self._publisher.submit(lambda: self._publish_queued(manifest), 1),
                                      lambda _future: None)
        if said != QUEUED:  # full (or closing): dropped and counted, never waited for
            self.counters["publish_dropped"] += 1

    def _publish_queued(self, manifest: Manifest) -> bool:
        """One queued publish, on the publisher's thread; never raises, so the thread serves the next one."""
        if self._closed:  # close() gave up waiting for it
            self.counters["publish_dropped"] += 1
            return False
        try:
            return self.publish(manifest)
        except Exception:  # a publish never takes the thread down; it is counted and the queue moves on
            self.counters["publish_failed"] += 1
            return False

    def publish(self, manifest: Manifest) -> bool:
        """Upload one locally committed snapshot (missing chunks, then the index entry). False: not published."""
        if not self.breaker.allow():
            self.counters["publish_dropped"] += 1
            return False
        marker = self.keys.publishing(uuid.uuid4().hex)
        try:
            with translate("publish"):
                self.client.set(marker, self.host, px=MARKER_MS)
                try:
                    if self.client.exists(self.keys.gc):
                        self.counters["publish_skipped"] += 1
                        self.breaker.success()
                        return False
                    self._upload(manifest, marker)
                    self._commit(manifest)
                finally:
                    self.client.delete(marker)
        except SnapshotNotFound:  # replaced or evicted locally before it could be read back: nothing to publish
            self.counters["publish_skipped"] += 1
            return False
        except _REMOTE_ERRORS:
            self.breaker.failure()
            self.counters["publish_failed"] += 1
            return False
        self.breaker.success()
        self.counters["published"] += 1
        return True

    def _upload(self, manifest: Manifest, marker: str) -> None:
        refs = local.unique_refs(manifest)
        pipe = self.client.pipeline(transaction=False)
        for r in refs:
            pipe.exists(self.keys.chunk(r.hash))
        present = pipe.execute()
        missing = [r for r, here in zip(refs, present) if not here]
        self.counters["chunks_present"] += len(refs) - len(missing)
        if not missing:
            return
        with self._lease(manifest, [r.hash for r in missing]):
            for r in missing:
                buffers = local.chunk_buffers(self.ctx, r.hash)
                self.counters["bytes_uploaded"] += self.chunks.put(self.keys.chunk_name(r.hash), buffers)
                self.counters["chunks_uploaded"] += 1
                self.client.pexpire(marker, MARKER_MS)
                seams.PUBLISH_HOOK(r.hash)

    def _commit(self, manifest: Manifest) -> None:
        nsk = namespace_key(self.ctx.id_key, manifest.namespace)
        sid = bytes.fromhex(manifest.snapshot_id)
        tokens = local.tokens_of(manifest)
        sess = self.keys.sessions(nsk)
        old_hex = self.client.hget(sess, manifest.session_id)
        old = bytes.fromhex(old_hex.decode()) if old_hex and old_hex.decode() != manifest.snapshot_id else None
        old_tokens = self._tokens_or_none(nsk, old) if old is not None else None
        summary = RemoteSummary(manifest.session_id, manifest.namespace, manifest.model_id, manifest.length,
                                manifest.minimum_reusable_offset, manifest.trimmable, manifest.nbytes,
                                manifest.created_at, [r.hash for r in local.unique_refs(manifest)], self.host)
        pipe = self.client.pipeline(transaction=True)
        if old is not None:
            self._drop_ops(pipe, nsk, old, old_tokens)
        pipe.set(self.keys.summary(nsk, sid), encode_summary(summary))
        pipe.set(self.keys.tokens(nsk, sid), encode_tokens(tokens))
        pipe.set(self.keys.manifest(nsk, sid), seal(schema.encode(manifest)))
        for key, member in boundary_members(nsk, tokens, sid, self.keys):
            pipe.zadd(key, {member: 0})
        pipe.hset(sess, manifest.session_id, manifest.snapshot_id)
        pipe.execute()

    def _tokens_or_none(self, nsk: bytes, sid: bytes):
        try:
            return decode_tokens(self.client.get(self.keys.tokens(nsk, sid)), "tokens")
        except CorruptData:
            return None

    def _drop_ops(self, pipe, nsk: bytes, sid: bytes, tokens) -> None:
        if tokens is not None:
            for key, member in boundary_members(nsk, tokens, sid, self.keys):
                pipe.zrem(key, member)
        pipe.delete(self.keys.summary(nsk, sid), self.keys.tokens(nsk, sid), self.keys.manifest(nsk, sid))

    def drop_entry(self, nsk: bytes, sid: bytes, session_id: str | None = None) -> None:
        """Remove one snapshot's index entry (its boundary records too, when its tokens are still readable)."""
        with translate("drop an index entry"):
            tokens = self._tokens_or_none(nsk, sid)
            pipe = self.client.pipeline(transaction=True)
            self._drop_ops(pipe, nsk, sid, tokens)
            pipe.execute()
            if session_id is not None:
                sess = self.keys.sessions(nsk)
                if self.client.hget(sess, session_id) == sid.hex().encode():
                    self.client.hdel(sess, session_id)
        self.counters["dropped_entries"] += 1

    # ------------------------------------------------------------------ lookup
    def lookup(self, prompt: LazyTokens, namespace: str, local_hit: PrefixHit | None) -> PrefixHit | None:
        """The remote hit if strictly longer than ``local_hit`` (which is returned otherwise). Never raises for a
        remote fault: a failure is a miss and tells the breaker."""
        if prompt.n < 2 or (local_hit is not None and local_hit.length >= prompt.n - 1):
            return local_hit
        if not self.breaker.allow():
            return local_hit
        self.counters["lookups"] += 1
        nsk = namespace_key(self.ctx.id_key, namespace)
        try:
            with translate("lookup"):
                best = PrefixSearch(RedisRecords(self.client, self.keys, nsk, exclude=self._unloadable), nsk,
                                    prompt).run()
        except _REMOTE_ERRORS:
            self.breaker.failure()
            self.counters["lookup_errors"] += 1
            return local_hit
        self.breaker.success()
        if best is None or (local_hit is not None and best[0] <= local_hit.length):
            self.counters["misses"] += 1
            return local_hit
        p, s, sid = best.length, best.summary, best.sid
        self.counters["hits"] += 1
        with self._memo_lock:  # serving threads look up concurrently
            self._memo[sid.hex()] = (nsk, s.namespace)
            while len(self._memo) > 4096:
                self._memo.popitem(last=False)
        return PrefixHit(s.session_id, sid.hex(), p, s.namespace, s.length)

    def knows(self, snapshot_id: str) -> bool:
        return snapshot_id in self._memo

    # ------------------------------------------------------------------ restore
    def localize(self, request):
        """A ``restore_batch`` request naming a remote hit → the local copy it is imported as (others unchanged)."""
        if not isinstance(request, PrefixHit) or not self.knows(request.snapshot_id) or \
                self.snapshots.has(request.snapshot_id):
            return request
        self.restore(request.snapshot_id, request.length, keep=True, strict=True)
        return (IMPORTED + request.snapshot_id, request.namespace)

    def restore(self, snapshot_id: str, length: int | None, *, keep: bool | None = None,
                strict: bool = False) -> Restored:
        """A remote hit restored bit-exact, or ``SnapshotNotFound`` (gone, corrupt, unreachable: a miss). ``keep``
        overrides ``keep_local``; ``strict``: a failed local copy raises instead of being counted."""
        with self._memo_lock:
            found = self._memo.get(snapshot_id)
        if found is None:
            raise SnapshotNotFound(f"snapshot {snapshot_id} is neither local nor a remote hit of this handle")
        nsk, namespace = found
        sid = bytes.fromhex(snapshot_id)
        if not self.breaker.allow():
            raise SnapshotNotFound(f"remote snapshot {snapshot_id}: the remote tier {self.where} is unavailable")
        self.counters["restores"] += 1
        try:
            with translate("restore"):
                manifest = self._manifest(nsk, sid)
                p = local.check_manifest(self.ctx, manifest, namespace, length)
                caches = local.build_caches(self.ctx, manifest, p, fetch.filler(self, local.needed_refs(manifest, p)))
        except _REMOTE_ERRORS as exc:
            self.counters["restore_errors"] += 1
            self.breaker.failure()
            self.counters["restore_misses"] += 1
            raise SnapshotNotFound(f"remote snapshot {snapshot_id}: {exc}") from None
        except (IncompatibleFormat, _NotOurs) as exc:  # fine for the hosts that made it: a miss here, not retried
            self.counters["restore_misses"] += 1
            self._memo.pop(snapshot_id, None)
            if len(self._unloadable) < 65536:
                self._unloadable.add(sid)
            raise SnapshotNotFound(f"remote snapshot {snapshot_id} cannot be loaded on this host: {exc}") from None
        except (CorruptData, _Missing) as exc:
            self.breaker.success()
            self.counters["restore_misses"] += 1
            self._memo.pop(snapshot_id, None)
            try:
                self.drop_entry(nsk, sid)
            except _REMOTE_ERRORS:
                self.breaker.failure()
            raise SnapshotNotFound(f"remote snapshot {snapshot_id} cannot be served ({exc}); its remote index "
                                   f"entry was dropped") from None
        self.breaker.success()
        restored = Restored(list(manifest.tokens[:p]), caches, p, manifest.session_id, manifest.snapshot_id,
                            manifest.namespace)
        if self.keep_local if keep is None else keep:
            try:
                self._save(IMPORTED + snapshot_id, restored.tokens, caches, namespace)
                self.counters["kept_local"] += 1
            except KvShelfError:  # a full disk or budget: the restore itself still succeeded
                self.counters["keep_local_failed"] += 1
                if strict:
                    raise
        return restored

    def _manifest(self, nsk: bytes, sid: bytes) -> Manifest:
        raw = self.client.get(self.keys.manifest(nsk, sid))
        if raw is None:
            raise _Missing(f"remote manifest {sid.hex()} is gone")
        return schema.decode(unseal(raw, f"manifest {sid.hex()}"), Manifest, f"remote manifest {sid.hex()}")

    def good_copy(self, hash_: str) -> local.RemoteChunk | None:
        """The tier's verified copy of one chunk (``repair``'s source when a local copy failed its hash), or None;
        a remote failure is ``BackendUnavailable`` (the breaker is fed)."""
        if not self.breaker.allow():
            return None
        try:
            with translate("repair"):
                chunk = fetch.good_copy(self.client, self.keys, hash_, self.counters)
        except _REMOTE_ERRORS:
            self.breaker.failure()
            raise
        self.breaker.success()
        return chunk

    # ------------------------------------------------------------------ reporting
    def _breaker_changed(self, state: str) -> None:
        if state == "open":
            self._outage_since = time.monotonic()
            log.warning("kvshelf shared tier %s unreachable: not asked again until it answers (lookups miss to "
                        "the local store, publishes are dropped)", self.where)
        else:
            since, self._outage_since = self._outage_since, None
            log.warning("kvshelf shared tier %s reachable again%s", self.where,
                        f" after {time.monotonic() - since:.1f} s" if since is not None else "")

    def stats(self) -> dict[str, Any]:
        return {"remote": self.where, "prefix": self.prefix, "breaker": self.breaker.state,
                "queued": self._publishes.pending, **self.counters}


__all__ = ["RemoteTier", "IMPORTED"]
