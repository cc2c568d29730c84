"""The restore calls of a ``Store``: whole, by id, batched — each leasing what it reads, reading it straight into
the final arrays (``direct.read_direct``) or a batched destination, quarantining a snapshot whose chunk fails
verification. No write transaction and no fsync on any of these paths. (``restore_prefix`` is the façade's: a
``lookup``, then ``restore_snapshot``.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Sequence
from typing import Any

from ...errors import CorruptData, IncompatibleFormat, InvalidCacheState, SnapshotNotFound
from ..context import StoreContext
from ..index.schema import Manifest
from ..liveness.leases import Gone, Leases, Stale
from ..results import PrefixHit, Restored, RestoredBatch
from . import direct as restoring
from .destinations import BatchDestinations, fill_from_chunk, slot_index
from .snapshots import Snapshots


if TYPE_CHECKING:  # the quarantine is handed in; the restore room does not import integrity
    from ..integrity.quarantine import Quarantine

class Reader:
    """One handle's restores (arguments checked by the façade, through ``inputs``). ``ctx.tier``: the shared tier,
    asked for snapshots this store does not hold."""

    def __init__(self, ctx: StoreContext, leases: Leases, snapshots: Snapshots, quarantine: Quarantine):
        self.ctx, self.leases, self.snapshots, self.quarantine = ctx, leases, snapshots, quarantine

    def restore(self, session_id: str, namespace: str = "") -> Restored:
        """The session's latest snapshot, whole."""
        for attempt in range(3):
            with self.ctx.index.read() as txn:
                manifest = self.snapshots.latest(txn, session_id, namespace)
            try:
                return self._restore(manifest, manifest.length)
            except SnapshotNotFound:  # replaced by a newer save between reading the pointer and leasing: again
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def restore_snapshot(self, snapshot_id: str, length: int | None = None) -> Restored:
        """A snapshot by id (cut to ``length`` if given); another identity's snapshot raises ``IdentityMismatch``."""
        tier = self.ctx.tier
        if tier is not None and tier.knows(snapshot_id) and not self.snapshots.has(snapshot_id):
            return tier.restore(snapshot_id, length)  # a remote hit: fetched, verified, kept locally
        manifest = self.snapshots.manifest(snapshot_id)
        self.snapshots.check_identity(manifest)
        p = manifest.length if length is None else int(length)
        check_cut(manifest, p)
        return self._restore(manifest, p)

    def restore_batch(self, requests: Sequence[str | PrefixHit | tuple[str, str]], _attempt: int = 0) -> RestoredBatch:
        """Several rows restored straight into one batched cache per layer, rows in request order."""
        if not requests:
            raise InvalidCacheState("restore_batch needs at least one request")
        tier = self.ctx.tier
        if tier is not None and _attempt == 0:  # remote hits are imported first, then read as local rows
            requests = [tier.localize(req) for req in requests]
        plans = []
        with self.ctx.index.read() as txn:
            for req in requests:
                if isinstance(req, PrefixHit):
                    manifest = self.snapshots.in_txn(txn, bytes.fromhex(req.snapshot_id))
                    self.snapshots.check_identity(manifest)
                    plans.append((manifest, req.length))
                    continue
                session_id, namespace = (req if isinstance(req, tuple) else (req, ""))
                manifest = self.snapshots.latest(txn, session_id, namespace)
                plans.append((manifest, manifest.length))
        for manifest, p in plans:
            check_cut(manifest, p)
        reads: list[restoring.Read] = []
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

    def _read_batch(self, reads: list[restoring.Read]) -> list[Any]:
        """Every row read straight into one destination per batched tensor of each layer whose codec gives a
        ``batch_plan``, then wrapped by ``adopt_batch``; other layers go through per-row arrays and ``load_batch``."""
        n_layers = len(reads[0].entries)
        if any(len(r.entries) != n_layers for r in reads):
            raise InvalidCacheState(f"restore_batch rows have different layer counts: {[len(r.entries) for r in reads]}")
        codecs, plans = [], []
        for layer in range(n_layers):
            entries = [r.entries[layer] for r in reads]
            codec = self.ctx.provider.for_entry(entries[0])
            codecs.append(codec)
            plan_of = getattr(codec, "batch_plan", None)  # a foreign codec may have no direct path
            plans.append(plan_of(entries) if plan_of is not None else None)
        objects = restoring.Objects(self.ctx.bytes, self.ctx.keys)
        try:
            # every row's chunk headers first, each row checked as a single-row restore checks it (Σ bytes its
            # chunks bring to each slot = the bytes the slot declares): a record whose shapes disagree with its
            # chunks is CorruptData before the batch allocates a single destination (which could be huge)
            readers = [self._open_chunks(read, objects, also=[r for r in reads if r is not read]) for read in reads]
            dest = BatchDestinations(plans, [r.entries for r in reads])
            for b, read in enumerate(reads):
                self._fill(read, dest.row(b), readers[b], also=[r for r in reads if r is not read])
        finally:
            objects.close()
        caches = []
        for layer, (codec, (batched, per_row)) in enumerate(zip(codecs, dest.finish())):
            entries = [r.entries[layer] for r in reads]
            if batched is not None:
                caches.append(codec.adopt_batch(entries, batched))
            else:
                caches.append(codec.load_batch(entries, per_row, verify=False))
        self.ctx.counters.batch_layers_direct += sum(plan is not None for plan in plans)
        self.ctx.counters.batch_layers_fallback += sum(plan is None for plan in plans)
        return caches

    def _restore(self, manifest: Manifest, p: int) -> Restored:
        entries, arrays, planned = self.read_arrays(manifest, p, direct=True)
        caches = [self.ctx.provider.for_entry(e).adopt_row(e, a) if pl else
                  self.ctx.provider.for_entry(e).load(e, a, verify=False) for e, a, pl in zip(entries, arrays, planned)]
        return Restored(list(manifest.tokens[:p]), caches, p, manifest.session_id, manifest.snapshot_id,
                        manifest.namespace)

    def _single_row_plans(self, entries: list) -> list:
        """Per layer the codec's batch plan for this one row (None: no direct path): read into it, the codec adopts
        the arrays as they are (``adopt_row``) instead of copying them into its layout (``load``). Only codecs whose
        one-row batch is their serial cache offer ``adopt_row`` — or codecs with a ``row_plan(entry)``, the serial
        cache's own buffer (mlx-lm's ``KVCache`` with its spare capacity), which is then taken instead."""
        plans = []
        for e in entries:
            codec = self.ctx.provider.for_entry(e)
            plan_of = getattr(codec, "batch_plan", None) if hasattr(codec, "adopt_row") else None
            row_plan = getattr(codec, "row_plan", None) if plan_of is not None else None
            plan = None
            if plan_of is not None and e.tensors:
                plan = row_plan(e) if row_plan is not None else plan_of([e])
            if plan is not None and (not plan.tensors or any(t.token_axis is None for t in plan.tensors)
                                     or len(plan.targets()) != len(e.tensors)):
                plan = None
            plans.append(plan)
        return plans

    def read_arrays(self, manifest: Manifest, p: int, direct: bool = False):
        """Lease the snapshot, read the chunks covering [0, p) into fresh arrays, verify, release: (entries, arrays)
        — or, with ``direct``, (entries, arrays, planned per layer) where planned layers hold batch-plan tensors."""
        for attempt in range(3):
            read = self._open_read(manifest, p)
            objects = restoring.Objects(self.ctx.bytes, self.ctx.keys)
            try:
                plans = self._single_row_plans(read.entries) if direct else None
                try:
                    arrays, n_chunks, n_bytes = restoring.read_direct(objects, read, self.ctx.verify_reads, plans)
                except CorruptData as exc:
                    if attempt < 2 and self._moved(read):
                        continue  # re-encoded or rewritten under us: lease and read the new form
                    self._corrupt(read, exc)
                read.ok = True
            finally:
                objects.close()
                self._close_read(read)
            break
        self.ctx.counters.chunks_read += n_chunks
        self.ctx.counters.bytes_read += n_bytes
        if direct:
            return read.entries, arrays, [pl is not None for pl in plans]
        return read.entries, arrays

    def _moved(self, read: restoring.Read) -> bool:
        """Whether the chunks of ``read`` lie elsewhere now (or the snapshot was rewritten or removed): a failed
        read is then retried on the new form, never taken for corruption."""
        try:
            with self.ctx.index.read() as txn:
                return self.leases.locate(txn, read.manifest, read.needed) != read.where
        except (Stale, Gone):
            return True

    def _open_read(self, manifest: Manifest, p: int) -> restoring.Read:
        """The entries cut to ``p`` and the chunks covering [0, p), leased (re-reading a manifest compacted since)."""
        for attempt in range(4):
            self.ctx.provider.check_provider(manifest.provider)
            for i, e in enumerate(manifest.entries):  # header checks before any lease, read or allocation
                codec = self.ctx.provider.for_entry(e)  # an unknown kind stays IncompatibleFormat (a newer kvshelf)
                try:
                    codec.validate(e, i)
                except (InvalidCacheState, IncompatibleFormat) as exc:  # a record contradicting its own geometry
                    raise CorruptData(f"session {manifest.session_id!r} (snapshot {manifest.snapshot_id}): its "
                                      f"manifest entry {i} is invalid ({exc}); refused before reading") from None
            entries = list(manifest.entries)
            for entry in entries:  # an unknown kind is refused before any chunk is read
                self.ctx.provider.for_entry(entry)
            if p < manifest.length:
                entries = [self.ctx.provider.for_entry(e).prefix_entry(e, p) for e in entries]
            needed = [r for r in manifest.chunks if r.start < p] + list(manifest.own)
            try:
                key, where = self.leases.take(manifest, needed, with_where=True)
                return restoring.Read(manifest, entries, needed, key, where)
            except Stale:  # rewritten in place (compaction) since we read it: same id, same tokens, new chunks
                if attempt == 3:
                    raise
                manifest = self.snapshots.manifest(manifest.snapshot_id)
        raise AssertionError("unreachable")

    def _open_chunks(self, read: restoring.Read, objects: restoring.Objects, also: Sequence = ()) -> list:
        """The readers of every chunk ``read`` needs (headers only: no tensor byte yet), after the single-row
        path's own coverage check (``direct.check_coverage``, reused as it is) on them. A missing or damaged
        chunk, or a record whose slots its chunks do not exactly fill, releases the leases of ``read`` and
        ``also``, quarantines the snapshot and raises ``CorruptData`` — as a single-row restore of it would."""
        readers, ref = [], None
        try:
            for ref in read.needed:
                readers.append(objects.chunk(ref, read.where[ref.hash], self.ctx.verify_reads))
            ref = None
            restoring.check_coverage(read, _coverage_slots(read, readers), readers)
        except CorruptData as exc:
            self._corrupt(read, exc, ref, also)
        return readers

    def _fill(self, read: restoring.Read, dest, readers: list, also: Sequence = ()) -> None:
        """Read every needed chunk (``readers``, from ``_open_chunks``) into ``dest`` (the batched path); a chunk
        failing verification releases this read's lease (and those of ``also``), quarantines the snapshot and
        raises ``CorruptData``."""
        for ref, reader in zip(read.needed, readers):
            try:
                with reader:
                    self.ctx.counters.bytes_read += fill_from_chunk(reader, ref, dest)
                    self.ctx.counters.chunks_read += 1
            except CorruptData as exc:
                self._corrupt(read, exc, ref, also)

    def _corrupt(self, read: restoring.Read, exc: CorruptData, ref=None, also: Sequence = ()) -> None:
        manifest = read.manifest
        for other in (read, *also):
            self._close_read(other)
        if ref is None:
            ref = next((r for r in read.needed if r.hash in str(exc)), None)
        where = "" if ref is None else f"chunk {ref.hash} covering tokens [{ref.start}, {ref.stop}) "
        bad = () if ref is None or ref.hash not in read.where else ((ref.hash, read.where[ref.hash]),)
        self.quarantine.quarantine(manifest.snapshot_id, str(exc), bad)
        raise CorruptData(f"session {manifest.session_id!r} (snapshot {manifest.snapshot_id}): {where}failed "
                          f"verification: {exc}; the snapshot is quarantined") from None

    def _close_read(self, read: restoring.Read) -> None:
        """Release the lease once (a successful read also counts as a use of the snapshot)."""
        if read.lease is not None:
            lease, read.lease = read.lease, None
            self.leases.release(lease, bytes.fromhex(read.manifest.snapshot_id) if read.ok else None, read.needed)


def check_cut(manifest: Manifest, p: int) -> None:
    if not 0 <= p <= manifest.length:
        raise InvalidCacheState(f"cannot cut snapshot {manifest.snapshot_id} of {manifest.length} tokens to {p}")
    if p < manifest.length and (not manifest.trimmable or p < manifest.minimum_reusable_offset):
        raise InvalidCacheState(f"snapshot {manifest.snapshot_id} cannot be cut to {p} tokens "
                                f"(trimmable={manifest.trimmable}, floor={manifest.minimum_reusable_offset})")


def _coverage_slots(read: restoring.Read, readers: list) -> list:
    """Per layer and slot of ``read.entries`` the single-row path's destination record (``direct._Slot``) with
    the chunk tensors that fill it, which is what ``check_coverage`` compares; a tensor naming no slot is corrupt."""
    slots = [[restoring._Slot(i, j, s) for j, s in enumerate(e.tensors)] for i, e in enumerate(read.entries)]
    for c, (ref, reader) in enumerate(zip(read.needed, readers)):
        for k, t in enumerate(reader.tensors):
            i, j = slot_index(t.name)
            if i >= len(slots) or j >= len(slots[i]):
                raise CorruptData(f"chunk {ref.hash}: tensor {t.name!r} names no slot of this snapshot")
            slots[i][j].pieces.append((c, ref, k))
    return slots


__all__ = ["Reader", "check_cut"]
