"""The commit / drop / refcount ledger: what one write transaction does to index a snapshot or remove one.

Why here and alone: every path that changes which snapshots exist (save, replace, delete, evict, quarantine,
rebuild) must keep the same books — chunk refcounts and locations, per-pack live counts, total stored bytes, the
summary / tokens / prefix / session / LRU records — and decide the same way what may be unlinked. Nothing here
touches the byte store: a drop only *returns* the objects that may have lost their last use; ``Store._reclaim``
unlinks them in a later write transaction after re-checking (``object_live``) and consulting the leases.

Order inside ``commit``: the new snapshot's chunk references are counted *before* the replaced snapshot is dropped,
so a chunk both share never reaches zero in between; the session's prefix records move to the new snapshot
(``records.move_head``: only the ones that changed) before the replaced snapshot's tokens record goes.
"""

from __future__ import annotations

import time

import numpy as np

from msgspec.structs import replace

from ...errors import CorruptData
from ..index import bad_chunks, keys, tables
from ..prefix import records
from ..index import schema
from ..index.schema import ChunkMeta, Manifest, PackMeta, Summary
from ..index.protocol import meta_int, set_meta_int
from ..objects.pack import is_pack


class MissingChunks(Exception):
    """Chunks the manifest names that neither have a record nor were placed by this save (a concurrent eviction
    removed them between the save's check and its commit): the save writes them again and retries."""

    def __init__(self, hashes: list[str]):
        self.hashes = hashes


Placed = dict[str, tuple[str, int, int, str, int]]  # hash -> (pack, offset, length, encoding, pack size), unindexed


def _bump_pack(index, txn, pack: str, chunks: int = 0, nbytes: int = 0, manifests: int = 0,
               size: int | None = None) -> None:
    m = tables.pack_meta(txn, pack) or PackMeta(0, 0, size or 0, 0)
    txn.put("packs", pack.encode(), schema.encode(replace(m, live_chunks=m.live_chunks + chunks,
                                                      live_bytes=m.live_bytes + nbytes, manifests=m.manifests + manifests,
                                                      size=size if size is not None else m.size)))


def commit(index, txn, manifest: Manifest, pack: str, pack_size: int, placed: Placed,
           replaces: bytes | None = None, now: int | None = None) -> tuple[bytes | None, list[str]]:
    """Index ``manifest`` (its manifest lies in ``pack``, "" for a v1 manifest file), replacing the session's
    previous snapshot (or ``replaces``). Returns (dropped sid, objects that may now be unreferenced)."""
    now = time.time_ns() if now is None else now
    unique = {r.hash: r for r in manifest.all_chunks}
    chunk_records = {h: txn.get("chunks", bytes.fromhex(h)) for h in unique}
    bad = {h for h, raw in chunk_records.items() if raw is not None and bad_chunks.is_bad(txn, h)}
    missing = [h for h, raw in chunk_records.items() if (raw is None or h in bad) and h not in placed]
    if missing:  # absent, or marked bad since the save looked: the save writes a fresh copy and retries
        raise MissingChunks(missing)
    idk, nsk, skey = keys.manifest_keys(manifest)
    sid = bytes.fromhex(manifest.snapshot_id)
    total = meta_int(txn, b"total_bytes")
    if pack and tables.pack_meta(txn, pack) is None:
        _bump_pack(index, txn, pack, size=pack_size)
    healed: list[str] = []  # objects the healed chunks left (the damaged copies: kept while quarantine holds them)
    for h, ref in unique.items():
        raw = chunk_records[h]
        if raw is None:
            where, offset, length, encoding, size = placed[h]
            if not is_pack(where):  # a v1 chunk file file found by rebuild_index
                where, offset = "", 0
            meta = ChunkMeta(1, ref.nbytes, length, encoding, now, where, offset)
            total += length
            if where:
                if tables.pack_meta(txn, where) is None:
                    _bump_pack(index, txn, where, size=size)
                _bump_pack(index, txn, where, chunks=1, nbytes=length)
        elif h in bad:  # the fresh copy this save wrote takes the name back: every snapshot using it is healed
            m = schema.decode(raw, ChunkMeta, f"chunk record {h}")
            where, offset, length, encoding, size = placed[h]
            left = keys.location(h, m)[0]
            if is_pack(left):
                _bump_pack(index, txn, left, chunks=-1, nbytes=-m.stored_bytes)
            if tables.pack_meta(txn, where) is None:
                _bump_pack(index, txn, where, size=size)
            _bump_pack(index, txn, where, chunks=1, nbytes=length)
            total += length - m.stored_bytes
            meta = ChunkMeta(m.refs + 1, m.nbytes, length, encoding, now, where, offset)
            bad_chunks.clear(txn, h)
            healed.append(left)
        else:
            m = schema.decode(raw, ChunkMeta, f"chunk record {h}")
            meta = replace(m, refs=m.refs + 1, last_used_ns=now)
        txn.put("chunks", bytes.fromhex(h), schema.encode(meta))
    set_meta_int(txn, b"total_bytes", total)
    if pack:
        _bump_pack(index, txn, pack, manifests=1)
    old = replaces if replaces is not None else txn.get("sessions", skey)
    tokens = np.asarray(manifest.tokens, dtype="<i8")
    records.move_head(txn, skey, sid, tokens)
    freed: list[str] = list(healed)
    if old is not None:
        freed += drop(index, txn, bytes(old), prefix_records=False)
    summary = Summary(idk, nsk, manifest.session_id, manifest.namespace, manifest.length,
                      manifest.minimum_reusable_offset, manifest.trimmable, manifest.nbytes, manifest.created_at, now,
                      pack)
    txn.put("manifests", sid, schema.encode(manifest))
    txn.put("summaries", sid, schema.encode(summary))
    txn.put("tokens", sid, schema.seal_tokens(tokens))
    txn.put("sessions", skey, sid)
    txn.put("lru", keys.lru_key(idk, now, sid), b"")
    txn.delete("quarantine", skey)
    return (bytes(old) if old is not None else None), freed


def drop(index, txn, sid: bytes, prefix_records: bool = True) -> list[str]:
    """Remove a snapshot from the index; returns the objects (packs, v1 chunk files, its v1 manifest file) that may have
    lost their last use. Its session's prefix records and head go with it (if it is the head) unless
    ``prefix_records`` is False: ``commit`` has already moved them to the snapshot replacing it."""
    manifest = tables.manifest(txn, sid)
    if manifest is None:
        return []
    summary = tables.summary(txn, sid)
    if summary is None:
        raise CorruptData(f"snapshot {sid.hex()} has a manifest record but no summary record (a damaged index: run "
                          f"`kvshelf verify`)")
    for name in ("manifests", "summaries", "tokens"):
        txn.delete(name, sid)
    skey = keys.summary_session_key(summary)
    if prefix_records:
        records.drop_head(txn, skey, sid, np.asarray(manifest.tokens, dtype="<i8"))
    if txn.get("sessions", skey) == sid:
        txn.delete("sessions", skey)
    txn.delete("lru", keys.lru_key(summary.id_key, summary.last_used_ns, sid))
    candidates: list[str] = []
    total = meta_int(txn, b"total_bytes")
    for h in {r.hash for r in manifest.all_chunks}:
        key = bytes.fromhex(h)
        m = tables.chunk_meta(txn, h)
        if m is None:
            continue
        if m.refs <= 1:
            txn.delete("chunks", key)
            bad_chunks.clear(txn, h)  # the mark names a copy no record points at any more
            total -= m.stored_bytes
            where = keys.location(h, m)[0]
            if is_pack(where):
                _bump_pack(index, txn, where, chunks=-1, nbytes=-m.stored_bytes)
            candidates.append(where)
        else:
            txn.put("chunks", key, schema.encode(replace(m, refs=m.refs - 1)))
    set_meta_int(txn, b"total_bytes", total)
    if summary.pack:
        _bump_pack(index, txn, summary.pack, manifests=-1)
        candidates.append(summary.pack)
    else:
        candidates.append(keys.legacy_manifest(sid.hex()))
    return candidates


def move_chunk(index, txn, hash_: str, pack: str, offset: int, length: int, encoding: str,
               pack_size: int) -> list[str]:
    """Point an indexed chunk at a new copy (recompression, repacking); returns the object it left."""
    key = bytes.fromhex(hash_)
    m = tables.chunk_meta(txn, hash_)
    if m is None:
        return []
    old = keys.location(hash_, m)[0]
    if old == pack and m.offset == offset:
        return []
    if is_pack(old):
        _bump_pack(index, txn, old, chunks=-1, nbytes=-m.stored_bytes)
    if tables.pack_meta(txn, pack) is None:
        _bump_pack(index, txn, pack, size=pack_size)
    _bump_pack(index, txn, pack, chunks=1, nbytes=length)
    total = meta_int(txn, b"total_bytes") - m.stored_bytes + length
    set_meta_int(txn, b"total_bytes", total)
    txn.put("chunks", key, schema.encode(replace(m, stored_bytes=length, encoding=encoding, pack=pack, offset=offset)))
    return [old]


def move_manifest(index, txn, sid: bytes, pack: str, pack_size: int) -> list[str]:
    """The snapshot's manifest now lies in ``pack`` too (an in-place rewrite): returns the object it left."""
    s = tables.summary(txn, sid)
    if s is None:
        return []
    if s.pack == pack:
        return []
    old = s.pack or keys.legacy_manifest(sid.hex())
    if s.pack:
        _bump_pack(index, txn, s.pack, manifests=-1)
    if tables.pack_meta(txn, pack) is None:
        _bump_pack(index, txn, pack, size=pack_size)
    _bump_pack(index, txn, pack, manifests=1)
    txn.put("summaries", sid, schema.encode(replace(s, pack=pack)))
    return [old]


def object_live(index, txn, name: str) -> bool:
    """Whether an object is still needed by the index: a pack with live chunks or a live manifest, a v1 chunk file whose
    chunk record still points at it, a v1 manifest file of an indexed snapshot."""
    if is_pack(name):
        m = tables.pack_meta(txn, name)
        return m is not None and (m.live_chunks > 0 or m.manifests > 0)
    legacy = keys.parse_legacy_chunk_file(name)
    if legacy is not None:
        h, encoding = legacy
        m = tables.chunk_meta(txn, h)
        return m is not None and not m.pack and m.encoding == encoding
    if name.startswith(keys.LEGACY_MANIFESTS) and name.endswith(".msgpack"):
        sid_hex = name[len(keys.LEGACY_MANIFESTS):-len(".msgpack")]
        try:
            sid = bytes.fromhex(sid_hex)
        except ValueError:
            return False
        s = tables.summary(txn, sid)
        return s is not None and not s.pack  # not moved into a pack
    return True  # anything else is not the ledger's to remove


def forget_pack(index, txn, name: str) -> None:
    if is_pack(name):
        txn.delete("packs", name.encode())


__all__ = ["MissingChunks", "Placed", "commit", "drop", "forget_pack", "move_chunk", "move_manifest", "object_live"]
