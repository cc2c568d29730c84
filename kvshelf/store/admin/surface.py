"""The offline tools' surface of a ``Store`` (``kvshelf.tools`` calls nothing else): listings, leases, chunk
re-encoding, in-place snapshot rewrites, repacking, the exclusive hold and index replacement.

Why a room of its own: these calls change the store behind live readers' backs, so each one states how it stays
invisible to them (leases honoured, one write transaction per swap, the old copy unlinked only by ``_reclaim``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any


from ...errors import CorruptData, IncompatibleFormat, InvalidCacheState, KvShelfError, StoreBusy
from .. import inputs
from ..index import keys, ledger
from ..liveness import open_lock as openlock
from ..restore import direct as restoring
from ..index import schema as mf
from ..objects.chunkfile import BlobReader, Piece, content_hash, kvz_buffers, raw_buffers
from ..objects.protocol import ObjectMissing
from ..index.lmdb_env import Index
from ..objects.local import open_object
from ..index.schema import BlobRef, ChunkMeta, Manifest, PackMeta, Summary
from ..objects.pack import PackBuilder, new_pack_name
from ..index.protocol import DUP_TABLES, PLAIN_TABLES, meta_int


class ToolsSurface:
    """Mixed into ``Store``."""

    # ------------------------------------------------------------------ listings
    def manifest(self, snapshot_id: str) -> Manifest:
        """A snapshot's manifest by id (any identity)."""
        snapshot_id = inputs.check_snapshot_id(snapshot_id)
        with self.index.read() as txn:
            return self._manifest(txn, _sid(snapshot_id))

    def iter_manifests(self, skip_damaged: bool = False) -> Iterator[Manifest]:
        """Every indexed manifest, all identities, streamed in batched read transactions (``Index.scan``). A record
        failing its checksum raises ``CorruptData`` naming it, or is left out with ``skip_damaged`` (``verify``
        reports it)."""
        for sid, raw in self.index.scan("manifests"):
            try:
                yield mf.decode(raw, Manifest, f"manifest {sid.hex()}")
            except (CorruptData, IncompatibleFormat):
                if not skip_damaged:
                    raise

    def chunk_info(self, hash_: str) -> ChunkMeta | None:
        """Refcount, payload bytes, stored bytes, encoding, last use and location of an indexed chunk."""
        with self.index.read() as txn:
            raw = txn.get("chunks", bytes.fromhex(hash_))
        return None if raw is None else mf.decode(raw, ChunkMeta, f"chunk record {hash_}")

    def iter_chunks(self, skip_damaged: bool = False) -> Iterator[tuple[str, ChunkMeta]]:
        """Every chunk record, streamed in batched read transactions (``skip_damaged``: as ``iter_manifests``)."""
        for key, raw in self.index.scan("chunks"):
            try:
                yield key.hex(), mf.decode(raw, ChunkMeta, f"chunk record {key.hex()}")
            except CorruptData:
                if not skip_damaged:
                    raise

    def iter_packs(self) -> Iterator[tuple[str, PackMeta]]:
        """Every indexed pack: live chunks and bytes, size, manifests held (compaction reads live ratios here)."""
        with self.index.read() as txn:
            rows = [(bytes(k).decode(), bytes(v)) for k, v in txn.range("packs")]
        for name, raw in rows:
            m = mf.decode(raw, PackMeta, f"pack record {name}")
            if m.live_chunks or m.manifests:  # emptied ones are unlinked (their records forgotten later)
                yield name, m

    def chunk_location(self, hash_: str) -> tuple[str, int, int] | None:
        """(object name, offset, length) of an indexed chunk; for a local store ``bytes.path(name)`` is its file."""
        info = self.chunk_info(hash_)
        if info is None:
            return None
        name, offset, length = keys.location(hash_, info)
        return name, offset, length if length is not None else (self.bytes.size(name) or 0)

    def stored_objects(self) -> Iterator[tuple[str, int]]:
        """(name, size) of every object in the byte store the store owns: packs, v1 blobs and manifest files."""
        for prefix in ("packs/", "blobs/"):
            for name in self.bytes.names(prefix):
                size = self.bytes.size(name)
                if size is not None:
                    yield name, size

    def orphans(self) -> list[tuple[str, str, int]]:
        """(name, kind, bytes) of crash residue: objects the index does not need and no live reader holds — kind
        ``orphan-blob`` (a pack or a v1 blob; name: pack object name or v1 hash) or ``orphan-manifest``."""
        from ..integrity.gc import orphan_objects

        self._check_open()
        return orphan_objects(self)

    def leased_hashes(self) -> set[str]:
        """Chunk hashes that live readers hold right now (never rewrite or remove these)."""
        return self._live_leases()[1]

    def open_blob(self, hash_: str, verify: bool = True) -> BlobReader:
        """A reader over one indexed chunk in whatever encoding it is stored (raw or zstd), wherever it lies.

        Unleased, so a re-encoding (``rewrite_blob``, repack) may move the chunk between reading its location and
        opening the object: a missing object is only called corrupt once the index, read again, still places the
        chunk there; otherwise the new location is opened (issue 12: re-encoding is invisible to readers)."""
        where = None
        for _attempt in range(4):
            info = self.chunk_info(hash_)
            if info is None:
                raise CorruptData(f"chunk {hash_} is not indexed")
            now = keys.location(hash_, info)
            if now == where:
                break  # it did not move: the object really is gone
            where = now
            restoring.before_open(where[0])
            try:
                source = open_object(self.bytes, where[0])
            except ObjectMissing:
                continue
            return BlobReader(None, hash_ if verify else None, source=source, base=where[1], length=where[2],
                              where=hash_, owns_source=True)
        raise CorruptData(f"chunk {hash_}: its object {where[0] if where else '?'} is missing")

    def summaries(self) -> dict[str, Summary]:
        """Every indexed snapshot's summary record, all identities: snapshot id -> ``Summary``."""
        self._check_open()
        return {k.hex(): mf.decode(raw, Summary, f"summary {k.hex()}") for k, raw in self.index.scan("summaries")}

    def stats(self) -> dict[str, Any]:
        """Counts and bytes: this identity's snapshots, the whole store's chunks, and this handle's counters."""
        self._check_open()
        with self.index.read() as txn:
            total = meta_int(txn, b"total_bytes")
            n_chunks = txn.count("chunks")
            n_packs = sum(1 for _k, v in txn.range("packs")
                          if (lambda m: m.live_chunks or m.manifests)(mf.decode(v, PackMeta, "pack record")))
            n_snapshots_all = txn.count("manifests")
            own = own_bytes = 0
            if self.id_key is not None:
                for key, _ in txn.range("lru", self.id_key, keys.after_prefix(self.id_key)):
                    own += 1
                    s = mf.decode(txn.get("summaries", keys.lru_sid(key)), Summary, "summary")
                    own_bytes += s.nbytes
            n_quarantined = txn.count("quarantine")
        return {"root": self.root, "model_id": None if self.identity is None else self.identity.model_id,
                "snapshots": own, "snapshot_bytes": own_bytes, "snapshots_all_identities": n_snapshots_all,
                "blobs": n_chunks, "packs": n_packs, "stored_bytes": total, "max_bytes": self.max_bytes,
                "quarantined_sessions": n_quarantined, "pending_bytes": self._writer.pending_bytes, **self.counters}

    def verify(self, deep: bool = False):
        """Inconsistencies between index and byte store (empty list: clean). ``deep`` re-hashes every chunk."""
        from ..integrity.verify import verify_store

        self._check_open()
        return verify_store(self, deep)

    def gc(self, dry_run: bool = True):
        """Remove crash residue: unreferenced packs, blobs and manifest files, dead tmp and lease files."""
        from ..integrity.gc import gc_store

        self._check_open()
        return gc_store(self, dry_run)

    def rebuild_index(self) -> int:
        """Rebuild the LMDB index from the packs' trailers (and v1 manifest files); returns snapshots indexed.
        What it left out and why (a damaged pack trailer, an undecodable manifest, a snapshot whose chunks are
        gone) is ``rebuild_report()``."""
        from ..integrity.rebuild import rebuild_store_index

        self._check_open()
        self._rebuild_skipped = []
        return rebuild_store_index(self, self._rebuild_skipped)

    def rebuild_report(self) -> list:
        """The ``Finding`` list of the last ``rebuild_index`` of this handle: every object or snapshot it skipped."""
        return list(getattr(self, "_rebuild_skipped", []))

    # ------------------------------------------------------------------ leases and chunk writes
    @contextmanager
    def lease(self, snapshot: Manifest | str, hashes: Sequence[str] | None = None) -> Iterator[Manifest]:
        """Hold a reader's lease on a snapshot's chunks (all of them unless ``hashes`` names some) for the block:
        no eviction, gc or recompression unlinks or rewrites them meanwhile. ``SnapshotNotFound`` when the snapshot
        is gone. Yields the manifest. Leaving the block releases the lease without counting as a use; objects that
        lost their last reference meanwhile are left for ``gc``."""
        self._check_open()
        manifest = snapshot if isinstance(snapshot, Manifest) else self.manifest(snapshot)
        refs = list(manifest.blobs) if hashes is None else [BlobRef(h, 0, 0, 0) for h in hashes]
        key = self._lease(manifest, refs)
        try:
            yield manifest
        finally:
            self._release(key, None, [])

    def put_blobs(self, items: Sequence[tuple[BlobRef, list[Piece]]]) -> list[str]:
        """Write the chunks not already indexed (raw, durable, in one pack; ``ref.hash`` must be the content hash of
        the pieces); returns the hashes written. Hold ``save_gate()`` (shared) from this call until they are
        referenced by a commit (``replace_manifest``), or a concurrent gc may take the pack for crash residue."""
        from ..save.saver import write_pack

        new, seen = [], set()
        for ref, pieces in items:
            if ref.hash in seen or self.chunk_info(ref.hash) is not None:
                continue
            if (got := content_hash(pieces)) != ref.hash:
                raise CorruptData(f"blob pieces hash to {got}, not to the name {ref.hash}")
            new.append((ref, pieces))
            seen.add(ref.hash)
        if new:
            _name, _size, placed = write_pack(self, new)
            with self._lock:
                self._placed.update(placed)
        return [r.hash for r, _ in new]

    @property
    def _placed(self) -> dict:
        """Chunks this handle wrote with ``put_blobs`` that no commit has indexed yet: where they lie."""
        placed = self.__dict__.get("_placed_chunks")
        if placed is None:
            placed = self.__dict__["_placed_chunks"] = {}
        return placed

    def rewrite_blob(self, hash_: str, encoding: str, *, level: int = 3) -> int | None:
        """Re-store a chunk in ``encoding`` ("raw" or "zstd", at zstd ``level``) under the same hash, as a one-chunk
        pack; returns stored bytes (None: skipped). The content is read and verified first; manifests do not change.
        Leased or unreferenced chunks are skipped, and so is one already in ``encoding``. Readers never see it
        happen: the record is repointed in one write transaction that re-checks the lease files, and the old copy is
        unlinked only by ``_reclaim`` (dead in the ledger, unleased)."""
        if encoding not in ("raw", "zstd"):
            raise ValueError(f"encoding must be 'raw' or 'zstd', got {encoding!r}")
        if not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"zstd level must be an int in 1..22, got {level!r}")
        with self.removers.removing(), self.save_gate():  # the move frees the old copy (removers.py)
            info = self.chunk_info(hash_)
            if info is None or info.encoding == encoding or hash_ in self.leased_hashes():
                return None
            with self.open_blob(hash_, verify=True) as reader:
                bufs = reader.read_into([None] * len(reader.tensors))
                pieces = [Piece(t.name, t.dtype, t.shape, b) for t, b in zip(reader.tensors, bufs)]
                metadata = dict(reader.metadata)
            frame = raw_buffers(pieces, metadata) if encoding == "raw" else kvz_buffers(pieces, metadata, level)
            builder = PackBuilder()
            builder.add(hash_, frame, encoding)
            name = new_pack_name()
            size = self.bytes.put(name, builder.finish(b""))
            offset, stored, _enc = builder.where[hash_]

            def move(txn):
                if hash_ in self.leased_hashes():
                    return None  # a reader leased it since: leave it where it is
                return ledger.move_chunk(self.index, txn, hash_, name, offset, stored, encoding, size)

            left = self._txn(move)
            if left is None:
                self._reclaim([name])
                return None
            self._reclaim(left + [name])
            return stored

    def repack(self, min_live_ratio: float = 0.5) -> dict[str, int]:
        """Move every v1 chunk blob, and every chunk of a pack whose live bytes fell under ``min_live_ratio`` of
        its size, into new packs (same hashes, same encodings); the emptied objects go when unleased. Returns counts
        (chunks moved, bytes moved, objects emptied). Snapshots' manifests in emptied packs move too."""
        from .repack import repack_store

        return repack_store(self, min_live_ratio)

    def replace_manifest(self, snapshot_id: str, new: Manifest, *, expected: Manifest | None = None) -> bool:
        """Atomically swap a snapshot's manifest for ``new`` (same session; its chunks must already be stored).

        Everything is re-checked inside the one write transaction: the snapshot must still be indexed, still be its
        session's latest, and (with ``expected``) still hold exactly ``expected``; otherwise nothing changes and
        False is returned. The new manifest is written first in a pack's trailer (what ``rebuild_index`` reads).
        Objects the swap freed are unlinked unless leased (``lease`` keeps them for readers); ``gc`` takes them later.
        """
        self._check_open()
        sid = _sid(snapshot_id)
        if new.snapshot_id != snapshot_id:
            raise InvalidCacheState(f"replace_manifest keeps the snapshot id ({snapshot_id}), got {new.snapshot_id}")
        base = expected if expected is not None else self.manifest(snapshot_id)
        if (new.session_id, new.namespace, keys.identity_key_of(new)) != (base.session_id, base.namespace,
                                                                          keys.identity_key_of(base)):
            raise InvalidCacheState("replace_manifest keeps the session, namespace and identity of the snapshot")
        skey = keys.manifest_keys(base)[2]
        with self.removers.removing():  # the swap frees the old chunks: hold it to their unlink (removers.py)
            with self.save_gate():
                pack = new_pack_name(snapshot_id, rewrite=True)
                size = self.bytes.put(pack, PackBuilder().finish(mf.encode(new)))
                with self._lock:
                    placed = dict(self._placed)

                def swap(txn):
                    current = txn.get("manifests", sid)
                    if current is None or txn.get("sessions", skey) != sid or (
                            expected is not None and mf.unseal(bytes(current), "manifest") != mf.unseal(
                                mf.encode(expected), "manifest")):
                        return None
                    return ledger.commit(self.index, txn, new, pack, size, placed, replaces=sid)

                result = self._txn(swap)
            if result is None:
                self._reclaim([pack])
                return False
            with self._lock:
                for r in new.blobs:
                    self._placed.pop(r.hash, None)
            self._reclaim(result[1])
            return True

    def replace_snapshot(self, old: Manifest, new: Manifest,
                         blobs: Mapping[str, list[Piece]] | Sequence[tuple[BlobRef, list[Piece]]] = ()) -> bool:
        """Rewrite a snapshot in place (same id, same session, e.g. compacted chunks): write the new chunks under
        the save gate, swap the manifest atomically (``replace_manifest(expected=old)``), with ``old``'s chunks leased
        across the swap so a reader that fetched the old manifest still finds every chunk it names. Returns False
        (the new chunks nothing references are left for ``_reclaim``) when the snapshot changed meanwhile."""
        if isinstance(blobs, Mapping):
            refs = {r.hash: r for r in new.blobs}
            items = [(refs[h], pieces) for h, pieces in blobs.items()]
        else:
            items = list(blobs)
        with self.lease(old), self.removers.removing():  # removers' lock before the gate (removers.py)
            with self.save_gate():
                for _attempt in range(5):
                    self.put_blobs(items)
                    try:
                        return self.replace_manifest(old.snapshot_id, new, expected=old)
                    except ledger.MissingChunks:  # indexed when checked, dropped before the commit: write again
                        continue
                raise KvShelfError(f"could not rewrite snapshot {old.snapshot_id}: chunks kept vanishing")

    # ------------------------------------------------------------------ offline: this handle alone
    @contextmanager
    def exclusive(self, timeout: float = 10.0) -> Iterator[None]:
        """Hold the store alone for an offline job (index compaction, ``rebuild_index``): no other process has it
        open (``locks/open.lock``), no other handle of this process does, no save is in flight (save gate held
        exclusively) and this process commits nothing else meanwhile. Raises ``StoreBusy`` naming who is in the way."""
        self._check_open()
        self.flush()
        if self._touches:
            self._txn(lambda txn: None)
        if openlock.users(self._lock_key) > 1 or getattr(self.index, "users", 1) > 1:
            raise StoreBusy(f"other store handles in this process have {self.root} open")
        try:
            gate = self.save_gate(exclusive=True, timeout=timeout)
            gate.__enter__()
        except StoreBusy:
            raise StoreBusy(f"saves kept the store at {self.root} busy for {timeout:.0f}s") from None
        try:
            with self.index.writer_lock(), openlock.exclusive(self._lock_key):
                yield
        finally:
            gate.__exit__(None, None, None)

    def replace_index(self, install: Callable[[str], None]) -> None:
        """Inside ``exclusive()``: close the LMDB environment, run ``install(index_dir)``, then open it again."""
        self._check_open()
        if not openlock.is_exclusive(self._lock_key):
            raise StoreBusy("replace_index needs the store held exclusively (use it inside store.exclusive())")
        if not isinstance(self.index, Index):
            raise InvalidCacheState(f"replace_index swaps an LMDB index directory; this store's index is "
                                    f"{type(self.index).__name__}")
        path = self.index.path
        map_size = self.index.map_size()
        self.index.close()
        try:
            install(path)
        finally:
            self.index = Index(path, map_size=map_size)

    def empty_index(self) -> None:
        """Inside ``exclusive()`` (``rebuild_index``): an empty index. LMDB's directory is replaced by a fresh one
        (no page of the old file survives); any other ``IndexStore`` has every table cleared in one transaction."""
        if isinstance(self.index, Index):
            self.replace_index(lambda path: shutil.rmtree(path, ignore_errors=True))
            return
        if not openlock.is_exclusive(self._lock_key):
            raise StoreBusy("empty_index needs the store held exclusively (use it inside store.exclusive())")
        self.index.write(lambda txn: [txn.clear(name) for name in (*PLAIN_TABLES, *DUP_TABLES)])

    def copy_index(self, target: str) -> None:
        """Inside ``exclusive()``: write a compacting copy of the index into directory ``target`` (tools swap it in
        with ``replace_index``)."""
        if not openlock.is_exclusive(self._lock_key):
            raise StoreBusy("copy_index needs the store held exclusively (use it inside store.exclusive())")
        if not isinstance(self.index, Index):
            raise InvalidCacheState(f"copy_index copies an LMDB index directory; this store's index is "
                                    f"{type(self.index).__name__}")
        self.index.copy_to(target)


def _sid(snapshot_id: str) -> bytes:
    try:
        sid = bytes.fromhex(snapshot_id)
    except (TypeError, ValueError):
        raise InvalidCacheState(f"snapshot id must be 32 hex digits, got {snapshot_id!r}") from None
    if len(sid) != 16:
        raise InvalidCacheState(f"snapshot id must be 32 hex digits, got {snapshot_id!r}")
    return sid


__all__ = ["ToolsSurface"]
