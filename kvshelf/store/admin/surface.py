"""The offline tools' surface of a store, ``store.admin`` (``kvshelf.tools`` calls nothing else): listings, leases,
chunk re-encoding, in-place snapshot rewrites, repacking, the exclusive hold and index replacement.

Why apart: these calls change the store behind live readers' backs, so each one states how it stays invisible to
them (leases honoured, one write transaction per swap, the old copy unlinked only by reclaim).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec

from ...errors import CorruptData, IncompatibleFormat, InvalidCacheState, KvShelfError
from ..context import StoreContext
from ..index import keys, tables
from ..liveness import ledger
from ..index import schema
from ..index.protocol import meta_int
from ..index.schema import ChunkRef, ChunkMeta, Manifest, PackMeta, Summary
from ..integrity.gc import Gc
from ..integrity.rebuild import Rebuild
from ..integrity.repair import marks
from ..integrity.verify import Verifier
from ..liveness.leases import Leases
from ..liveness.reclaim import Reclaimer
from ..liveness.save_gate import SaveGate
from ..liveness.transactions import Transactions
from ..objects.chunkfile import ChunkReader, Piece, content_hash, kvz_buffers, raw_buffers
from ..objects.pack import PackBuilder, new_pack_name
from ..restore.reader import Reader
from ..restore.chunks import chunk_info, open_chunk
from ..restore.snapshots import Snapshots, sid_bytes
from ..save.background import BackgroundWriter
from ..save.saver import Saver
from ..space.pins import Pins
from .index_swap import IndexSwap
from .repack import reclaimable, repack


class StoreAdmin:
    """What the offline tools call on a store (``store.admin``); the same calls on ``Store`` forward here."""

    def __init__(self, ctx: StoreContext, *, snapshots: Snapshots, leases: Leases, reclaimer: Reclaimer,
                 txns: Transactions, gate: SaveGate, saver: Saver, writer: BackgroundWriter, verifier: Verifier,
                 gc: Gc, rebuild: Rebuild, swap: IndexSwap, pins: Pins, reader: Reader):
        self.ctx, self.snapshots, self.leases, self.reclaimer, self.pins = ctx, snapshots, leases, reclaimer, pins
        self.reader = reader
        self.txns, self.gate, self.saver, self.writer = txns, gate, saver, writer
        self.verifier, self.sweeper, self.rebuilder, self.swap = verifier, gc, rebuild, swap
        self._placed: dict = {}  # chunks written by put_chunks that no commit has indexed yet: where they lie

    # ------------------------------------------------------------------ listings
    def read_arrays(self, manifest: Manifest, length: int) -> tuple[list, list]:
        """A snapshot's cache entries and arrays for ``[0, length)``, read under a lease and verified, without
        building caches: for a tool that converts or inspects arrays. A manifest rewritten in place meanwhile
        (compaction) is noticed in the lease transaction and read again."""
        return self.reader.read_arrays(manifest, length)

    def manifest(self, snapshot_id: str) -> Manifest:
        """A snapshot's manifest by id (any identity)."""
        return self.snapshots.manifest(snapshot_id)

    def iter_manifests(self, skip_damaged: bool = False) -> Iterator[Manifest]:
        """Every indexed manifest, all identities, streamed in batched read transactions (``Index.scan``). A record
        failing its checksum raises ``CorruptData`` naming it, or is left out with ``skip_damaged`` (``verify``
        reports it)."""
        for sid, raw in self.ctx.index.scan("manifests"):
            try:
                yield schema.decode(raw, Manifest, f"manifest {sid.hex()}")
            except (CorruptData, IncompatibleFormat):
                if not skip_damaged:
                    raise

    def chunk_info(self, hash_: str) -> ChunkMeta | None:
        """Refcount, payload bytes, stored bytes, encoding, last use and location of an indexed chunk."""
        return chunk_info(self.ctx.index, hash_)

    def iter_chunks(self, skip_damaged: bool = False) -> Iterator[tuple[str, ChunkMeta]]:
        """Every chunk record, streamed in batched read transactions (``skip_damaged``: as ``iter_manifests``)."""
        for key, raw in self.ctx.index.scan("chunks"):
            try:
                yield key.hex(), schema.decode(raw, ChunkMeta, f"chunk record {key.hex()}")
            except CorruptData:
                if not skip_damaged:
                    raise

    def iter_packs(self) -> Iterator[tuple[str, PackMeta]]:
        """Every indexed pack: live chunks and bytes, size, manifests held (compaction reads live ratios here)."""
        with self.ctx.index.read() as txn:
            rows = [(bytes(k).decode(), bytes(v)) for k, v in txn.range("packs")]
        for name, raw in rows:
            m = schema.decode(raw, PackMeta, f"pack record {name}")
            if m.live_chunks or m.manifests:  # emptied ones are unlinked (their records forgotten later)
                yield name, m

    def chunk_location(self, hash_: str) -> tuple[str, int, int] | None:
        """(object name, offset, length) of an indexed chunk; for a local store ``bytes.path(name)`` is its file."""
        info = self.chunk_info(hash_)
        if info is None:
            return None
        name, offset, length = keys.location(hash_, info)
        return name, offset, length if length is not None else (self.ctx.bytes.size(name) or 0)

    def stored_objects(self) -> Iterator[tuple[str, int]]:
        """(name, size) of every object in the byte store the store owns: packs, v1 chunk files and manifest files."""
        for prefix in ("packs/", "blobs/"):
            for name in self.ctx.bytes.names(prefix):
                size = self.ctx.bytes.size(name)
                if size is not None:
                    yield name, size

    def orphans(self) -> list[tuple[str, str, int]]:
        """(name, kind, bytes) of crash residue: objects the index does not need and no live reader holds — kind
        ``orphan-object`` (a pack or a v1 chunk file; name: pack object name or v1 hash) or ``orphan-manifest``."""
        self.ctx.check_open()
        return self.sweeper.orphans()

    def leased_hashes(self) -> set[str]:
        """Chunk hashes that live readers hold right now (never rewrite or remove these)."""
        return self.reclaimer.live_leases()[1]

    def open_chunk(self, hash_: str, verify: bool = True) -> ChunkReader:
        """A reader over one indexed chunk in whatever encoding it is stored (raw or zstd), wherever it lies.

        Unleased, so a re-encoding (``rewrite_chunk``, repack) may move the chunk between reading its location and
        opening the object: a missing object is only called corrupt once the index, read again, still places the
        chunk there; otherwise the new location is opened (re-encoding is invisible to readers)."""
        return open_chunk(self.ctx.index, self.ctx.bytes, hash_, verify, self.ctx.keys)

    def summaries(self) -> dict[str, Summary]:
        """Every indexed snapshot's summary record, all identities: snapshot id -> ``Summary``."""
        self.ctx.check_open()
        return {k.hex(): schema.decode(raw, Summary, f"summary {k.hex()}") for k, raw in self.ctx.index.scan("summaries")}

    def stats(self) -> dict[str, Any]:
        """Counts and bytes: this identity's snapshots, the whole store's chunks, this handle's counters (and the
        shared tier's, under ``remote``, when one is bound)."""
        ctx = self.ctx
        ctx.check_open()
        with ctx.index.read() as txn:
            total = meta_int(txn, b"total_bytes")
            n_chunks = txn.count("chunks")
            n_packs = sum(1 for _k, v in txn.range("packs")
                          if (lambda m: m.live_chunks or m.manifests)(schema.decode(v, PackMeta, "pack record")))
            n_snapshots_all = txn.count("manifests")
            own = own_bytes = 0
            if ctx.id_key is not None:
                for key, _ in txn.range("lru", ctx.id_key, keys.after_prefix(ctx.id_key)):
                    own += 1
                    s = tables.summary(txn, keys.lru_sid(key))
                    if s is None:
                        raise CorruptData(f"LRU record {key.hex()} names snapshot {keys.lru_sid(key).hex()}, which has "
                                          f"no summary (a damaged index: run `kvshelf verify`)")
                    own_bytes += s.nbytes
            n_quarantined = txn.count("quarantine")
        doc = {"root": ctx.root, "model_id": None if ctx.identity is None else ctx.identity.model_id,
               "snapshots": own, "snapshot_bytes": own_bytes, "snapshots_all_identities": n_snapshots_all,
               "chunks": n_chunks, "blobs": n_chunks, "packs": n_packs, "stored_bytes": total, "max_bytes": ctx.max_bytes,
               "quarantined_sessions": n_quarantined, "pending_bytes": self.writer.pending_bytes,
               "pinned_bytes": self.pins.pinned_bytes(), **ctx.counters}
        return {**doc, "remote": ctx.tier.stats()} if ctx.tier is not None else doc

    def verify(self, deep: bool = False):
        """Inconsistencies between index and byte store (empty list: clean). ``deep`` re-hashes every chunk."""
        self.ctx.check_open()
        return self.verifier.verify(deep)

    def gc(self, dry_run: bool = True):
        """Remove crash residue: unreferenced packs, v1 chunk files and manifest files, dead tmp and lease files."""
        if not dry_run:
            self.ctx.check_writable("gc")
        self.ctx.check_open()
        return self.sweeper.gc(dry_run)

    def quarantined(self) -> list[dict]:
        """Every quarantine record: snapshot id, session, namespace key and the reason (``kvshelf quarantine ls``)."""
        self.ctx.check_open()
        out = []
        for key, raw in self.ctx.index.scan("quarantine"):
            try:
                rec = msgspec.msgpack.decode(raw)
                sid, reason = str(rec[0]), str(rec[1])
            except (msgspec.DecodeError, ValueError, TypeError, IndexError):
                sid, reason = "?", "(the quarantine record itself is damaged)"
            out.append({"snapshot_id": sid, "session_id": keys.session_of_key(key), "reason": reason})
        return out

    def bad_chunks(self) -> list[dict]:
        """Every chunk copy marked bad and not yet healed or dropped: hash, pack, offset, reason."""
        self.ctx.check_open()
        return [{"hash": m.hash, "pack": m.pack, "offset": m.offset, "reason": m.reason} for m in marks(self.ctx)]

    def rebuild_index(self) -> int:
        """Rebuild the LMDB index from the packs' trailers (and v1 manifest files); returns snapshots indexed.
        What it left out and why (a damaged pack trailer, an undecodable manifest, a snapshot whose chunks are
        gone) is ``rebuild_report()``."""
        self.ctx.check_writable("rebuild_index")
        self.ctx.check_open()
        return self.rebuilder.rebuild()

    def rebuild_report(self) -> list:
        """The ``Finding`` list of the last ``rebuild_index`` of this handle: every object or snapshot it skipped."""
        return list(self.rebuilder.report)

    # ------------------------------------------------------------------ leases and chunk writes
    @contextmanager
    def lease(self, snapshot: Manifest | str, hashes: Sequence[str] | None = None) -> Iterator[Manifest]:
        """Hold a reader's lease on a snapshot's chunks (all of them unless ``hashes`` names some) for the block:
        no eviction, gc or recompression unlinks or rewrites them meanwhile. ``SnapshotNotFound`` when the snapshot
        is gone. Yields the manifest. Leaving the block releases the lease without counting as a use; objects that
        lost their last reference meanwhile are left for ``gc``."""
        self.ctx.check_open()
        manifest = snapshot if isinstance(snapshot, Manifest) else self.manifest(snapshot)
        refs = list(manifest.all_chunks) if hashes is None else [ChunkRef(h, 0, 0, 0) for h in hashes]
        key = self.leases.take(manifest, refs)
        try:
            yield manifest
        finally:
            self.leases.release(key, None, [])

    def put_chunks(self, items: Sequence[tuple[ChunkRef, list[Piece]]]) -> list[str]:
        """Write the chunks not already indexed (raw, durable, in one pack; ``ref.hash`` must be the content hash of
        the pieces); returns the hashes written. Hold ``save_gate()`` (shared) from this call until they are
        referenced by a commit (``replace_manifest``), or a concurrent gc may take the pack for crash residue."""
        self.ctx.check_writable("put_chunks")
        new, seen = [], set()
        for ref, pieces in items:
            if ref.hash in seen or self.chunk_info(ref.hash) is not None:
                continue
            if (got := content_hash(pieces)) != ref.hash:
                raise CorruptData(f"chunk pieces hash to {got}, not to the name {ref.hash}")
            new.append((ref, pieces))
            seen.add(ref.hash)
        if new:
            _name, _size, placed = self.saver.write_pack(new)
            with self.ctx.lock:
                self._placed.update(placed)
        return [r.hash for r, _ in new]

    def rewrite_chunk(self, hash_: str, encoding: str, *, level: int = 3) -> int | None:
        """Re-store a chunk in ``encoding`` ("raw" or "zstd", at zstd ``level``) under the same hash, as a one-chunk
        pack; returns stored bytes (None: skipped). The content is read and verified first; manifests do not change.
        Leased or unreferenced chunks are skipped, and so is one already in ``encoding``. Readers never see it
        happen: the record is repointed in one write transaction that re-checks the lease files, and the old copy is
        unlinked only by reclaim (dead in the ledger, unleased)."""
        self.ctx.check_writable("rewrite_chunk")
        if encoding not in ("raw", "zstd"):
            raise ValueError(f"encoding must be 'raw' or 'zstd', got {encoding!r}")
        if not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"zstd level must be an int in 1..22, got {level!r}")
        with self.ctx.removers.removing(), self.gate.hold():  # the move frees the old copy (removers.py)
            info = self.chunk_info(hash_)
            if info is None or info.encoding == encoding or hash_ in self.leased_hashes():
                return None
            with self.open_chunk(hash_, verify=True) as reader:
                bufs = reader.read_into([None] * len(reader.tensors))
                pieces = [Piece(t.name, t.dtype, t.shape, b) for t, b in zip(reader.tensors, bufs)]
                metadata = dict(reader.metadata)
                sealed = (reader.kid, reader.expect_hash) if reader.sealed else None
            frame = raw_buffers(pieces, metadata) if encoding == "raw" else kvz_buffers(pieces, metadata, level)
            if sealed is not None:  # encryption at rest: compressed, then sealed again under its tenant's key
                frame = [self.ctx.keys.by_id(sealed[0]).seal(hash_, sealed[1], frame)]
            builder = PackBuilder()
            builder.add(hash_, frame, encoding)
            name = new_pack_name()
            size = self.ctx.bytes.put(name, builder.finish(b""))
            offset, stored, _enc = builder.where[hash_]

            def move(txn):
                if hash_ in self.leased_hashes():
                    return None  # a reader leased it since: leave it where it is
                return ledger.move_chunk(self.ctx.index, txn, hash_, name, offset, stored, encoding, size)

            left = self.txns.write(move)
            if left is None:
                self.reclaimer.reclaim([name])
                return None
            self.reclaimer.reclaim(left + [name])
            return stored

    def reclaimable_packs(self) -> dict[str, int]:
        """Packs whose rewrite would end smaller (dead chunks, a replaced snapshot's manifest), with the bytes it would
        give back after its own overhead (``repack.reclaimable``): what ``kvshelf compact`` repacks."""
        out = {}
        for name, pm in self.iter_packs():
            gain = reclaimable(self.ctx, name, pm)
            if gain > 0:
                out[name] = gain
        return out

    def repack(self, min_live_ratio: float = 0.5, packs=None, v1: bool | None = None) -> dict[str, int]:
        """Move every v1 chunk file, and every chunk of a pack whose live bytes fell under ``min_live_ratio`` of
        its size, into new packs (same hashes, same encodings); the emptied objects go when unleased. Returns counts
        (chunks moved, bytes moved, objects emptied). Snapshots' manifests in emptied packs move too. ``packs``:
        exactly these packs instead (``repair`` rewrites a damaged trailer's pack so); ``v1``: move v1 files too
        (default: only without ``packs``)."""
        self.ctx.check_writable("repack")
        return repack(self, self.ctx, self.gate, self.txns, self.reclaimer, min_live_ratio, packs, v1)

    def replace_manifest(self, snapshot_id: str, new: Manifest, *, expected: Manifest | None = None) -> bool:
        """Atomically swap a snapshot's manifest for ``new`` (same session; its chunks must already be stored).

        Everything is re-checked inside the one write transaction: the snapshot must still be indexed, still be its
        session's latest, and (with ``expected``) still hold exactly ``expected``; otherwise nothing changes and
        False is returned. The new manifest is written first in a pack's trailer (what ``rebuild_index`` reads).
        Objects the swap freed are unlinked unless leased (``lease`` keeps them for readers); ``gc`` takes them later.
        """
        self.ctx.check_writable("replace_manifest")
        ctx = self.ctx
        ctx.check_open()
        sid = sid_bytes(snapshot_id)
        if new.snapshot_id != snapshot_id:
            raise InvalidCacheState(f"replace_manifest keeps the snapshot id ({snapshot_id}), got {new.snapshot_id}")
        base = expected if expected is not None else self.manifest(snapshot_id)
        if (new.session_id, new.namespace, keys.identity_key_of(new)) != (base.session_id, base.namespace,
                                                                          keys.identity_key_of(base)):
            raise InvalidCacheState("replace_manifest keeps the session, namespace and identity of the snapshot")
        skey = keys.manifest_keys(base)[2]
        with ctx.removers.removing():  # the swap frees the old chunks: hold it to their unlink (removers.py)
            with self.gate.hold():
                pack = new_pack_name(snapshot_id, rewrite=True)
                size = ctx.bytes.put(pack, PackBuilder().finish(schema.encode(new)))
                with ctx.lock:
                    placed = dict(self._placed)

                def swap(txn):
                    current = txn.get("manifests", sid)
                    if current is None or txn.get("sessions", skey) != sid or (
                            expected is not None and schema.unseal(bytes(current), "manifest") != schema.unseal(
                                schema.encode(expected), "manifest")):
                        return None
                    return ledger.commit(ctx.index, txn, new, pack, size, placed, replaces=sid)

                result = self.txns.write(swap)
            if result is None:
                self.reclaimer.reclaim([pack])
                return False
            with ctx.lock:
                for r in new.all_chunks:
                    self._placed.pop(r.hash, None)
            self.reclaimer.reclaim(result[1])
            return True

    def replace_snapshot(self, old: Manifest, new: Manifest,
                         blobs: Mapping[str, list[Piece]] | Sequence[tuple[ChunkRef, list[Piece]]] = ()) -> bool:
        """Rewrite a snapshot in place (same id, same session, e.g. compacted chunks): write the new chunks under
        the save gate, swap the manifest atomically (``replace_manifest(expected=old)``), with ``old``'s chunks leased
        across the swap so a reader that fetched the old manifest still finds every chunk it names. Returns False
        (the new chunks nothing references are left for reclaim) when the snapshot changed meanwhile."""
        self.ctx.check_writable("replace_snapshot")
        if isinstance(blobs, Mapping):
            refs = {r.hash: r for r in new.all_chunks}
            items = [(refs[h], pieces) for h, pieces in blobs.items()]
        else:
            items = list(blobs)
        with self.lease(old), self.ctx.removers.removing():  # removers' lock before the gate (removers.py)
            with self.gate.hold():
                for _attempt in range(5):
                    self.put_chunks(items)
                    try:
                        return self.replace_manifest(old.snapshot_id, new, expected=old)
                    except ledger.MissingChunks:  # indexed when checked, dropped before the commit: write again
                        continue
                raise KvShelfError(f"could not rewrite snapshot {old.snapshot_id}: chunks kept vanishing")

    # ------------------------------------------------------------------ offline: this handle alone
    def check_writable(self, what: str) -> None:
        """``StoreReadOnly`` naming ``what``, the path and the missing permission when this handle may not write
        the store: an offline job (``kvshelf compact``) refuses before its first step, under its own name rather
        than that of the first write it would have reached."""
        self.ctx.check_writable(what)

    def compacted_index_size(self, work_dir: str) -> int:
        """The bytes a compacting copy of the index would take (a dry run's plan), measured on a throwaway copy
        under ``work_dir`` (``index_swap.IndexSwap.compacted_size``): needs no hold and no write permission."""
        return self.swap.compacted_size(work_dir)

    def exclusive(self, timeout: float = 10.0):
        """Hold the store alone for an offline job (``index_swap.IndexSwap.exclusive``)."""
        self.ctx.check_writable("exclusive")
        return self.swap.exclusive(timeout)

    def replace_index(self, install: Callable[[str], None]) -> None:
        """Inside ``exclusive()``: close the LMDB environment, run ``install(index_dir)``, then open it again."""
        self.ctx.check_writable("replace_index")
        self.swap.replace_index(install)

    def empty_index(self) -> None:
        """Inside ``exclusive()``: an empty index (``index_swap.IndexSwap.empty_index``)."""
        self.ctx.check_writable("empty_index")
        self.swap.empty_index()

    def copy_index(self, target: str) -> None:
        """Inside ``exclusive()``: a compacting copy of the index into directory ``target``."""
        self.swap.copy_index(target)


__all__ = ["StoreAdmin"]
