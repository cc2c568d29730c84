"""Repacking: v1 chunk files and mostly-dead packs rewritten into fresh packs (``store.admin.repack``, ``kvshelf compact``).

Why: packs are immutable, so a pack whose chunks were mostly dropped keeps its dead bytes until every chunk it holds
is gone; and a v1 store keeps one file per chunk. Repacking copies each live chunk's frame as it is (same bytes,
same hash, same encoding — verified first) into new packs, repoints the chunk records in one write transaction per
pack (re-checking each record still points where it was read and no lease holds it), moves snapshot manifests out of
emptied packs and v1 manifest files into manifest-only packs, and lets reclaim unlink what emptied.
"""

from __future__ import annotations

from ...errors import CorruptData
from ..context import StoreContext
from ..index import keys
from ..liveness import ledger
from ..index import schema
from ..objects.protocol import open_object
from ..index.schema import ChunkMeta, Summary
from ..liveness.reclaim import Reclaimer
from ..liveness.save_gate import SaveGate
from ..liveness.transactions import Transactions
from ..objects.pack import PACK_MAGIC, TRAILER, TRAILER_MAGIC, PackBuilder, new_pack_name
from ..objects.protocol import ObjectMissing

PACK_TARGET = 256 << 20  # bytes of chunks per new pack


def repack(admin, ctx: StoreContext, gate: SaveGate, txns: Transactions, reclaimer: Reclaimer,
           min_live_ratio: float = 0.5, packs=None, v1: bool | None = None) -> dict[str, int]:
    """``admin`` (a ``StoreAdmin``) lists packs, chunks and leases and opens chunks; ``txns`` repoints records.
    ``packs``: exactly these packs instead of the sparse ones; ``v1``: move v1 chunk and manifest files too
    (default: only when ``packs`` is not given)."""
    v1 = packs is None if v1 is None else v1
    if not 0.0 <= min_live_ratio <= 1.0:
        raise ValueError(f"min_live_ratio must be within [0, 1], got {min_live_ratio!r}")
    if packs is not None:  # exactly these (a damaged trailer's pack, what compaction planned)
        sparse = set(packs)
    else:
        sparse = {name for name, pm in admin.iter_packs() if pm.size and pm.live_bytes / pm.size < min_live_ratio}
    moved = moved_bytes = 0
    left: list[str] = []
    with ctx.removers.removing():  # held to the unlink of what the moves emptied (removers.py)
        with gate.hold():
            leased = admin.leased_hashes()
            todo = [(h, m) for h, m in admin.iter_chunks()
                    if ((not m.pack and v1) or m.pack in sparse) and h not in leased]
            batch, size = [], 0
            for h, m in todo + [(None, None)]:
                if h is not None:
                    batch.append((h, m))
                    size += m.stored_bytes
                if batch and (h is None or size >= PACK_TARGET):
                    n, nb, gone = _move_batch(admin, ctx, txns, reclaimer, batch)
                    moved, moved_bytes, left = moved + n, moved_bytes + nb, left + gone
                    batch, size = [], 0
            with ctx.index.read() as txn:
                summaries = [(bytes(k), schema.decode(v, Summary, "summary"))
                             for k, v in txn.range("summaries")]
            for sid, s in summaries:
                if (s.pack and s.pack not in sparse) or (not s.pack and not v1):
                    continue
                raw = admin.manifest(sid.hex())
                pack = new_pack_name(sid.hex(), rewrite=True)
                psize = ctx.bytes.put(pack, PackBuilder().finish(schema.encode(raw)))
                gone = txns.write(lambda txn, sid=sid, pack=pack, psize=psize: ledger.move_manifest(
                    ctx.index, txn, sid, pack, psize))
                if gone:
                    left += gone
                else:
                    reclaimer.reclaim([pack])
        reclaimer.reclaim(left)
    return {"chunks_moved": moved, "bytes_moved": moved_bytes, "objects_emptied": len(set(left))}


def _move_batch(admin, ctx: StoreContext, txns: Transactions, reclaimer: Reclaimer, batch: list[tuple[str, ChunkMeta]]) -> tuple[int, int, list[str]]:
    builder = PackBuilder()
    for h, m in batch:
        name, offset, length = keys.location(h, m)
        with admin.open_chunk(h, verify=True) as reader:  # verified before anything is copied
            reader.read_into([None] * len(reader.tensors))
        with open_object(ctx.bytes, name) as r:
            n = length if length is not None else r.size()
            frame = bytearray(n)
            r.read_into(offset, [memoryview(frame)])
        builder.add(h, [frame], m.encoding)
    pack = new_pack_name()
    size = ctx.bytes.put(pack, builder.finish(b""))
    before = {h: (m.pack, m.offset, m.encoding) for h, m in batch}

    def move(txn):
        leased = admin.leased_hashes()
        gone, n, nb = [], 0, 0
        for h, (off, length, enc) in builder.where.items():
            raw = txn.get("chunks", bytes.fromhex(h))
            if raw is None or h in leased:
                continue
            now = schema.decode(raw, ChunkMeta, f"chunk record {h}")
            if (now.pack, now.offset, now.encoding) != before[h]:
                continue  # moved or re-encoded meanwhile: leave it
            gone += ledger.move_chunk(ctx.index, txn, h, pack, off, length, enc, size)
            n, nb = n + 1, nb + length
        return n, nb, gone

    try:
        n, nb, gone = txns.write(move)
    except CorruptData:
        reclaimer.reclaim([pack])
        raise
    if n == 0:
        reclaimer.reclaim([pack])
    return n, nb, gone


REWRITE_OVERHEAD = 4096  # a rewrite's new pack files (magic, trailers, a manifest-only pack): what it must beat


def reclaimable(ctx: StoreContext, name: str, pm) -> int:
    """Bytes a rewrite of pack ``name`` would give back: its size less its live chunks, its trailer (which carries
    its manifests and chunk table) and ``REWRITE_OVERHEAD`` — positive only when the rewrite ends smaller."""
    try:
        with open_object(ctx.bytes, name) as r:
            size = r.size()
            if size < len(PACK_MAGIC) + TRAILER.size:
                return 0
            tail = bytearray(TRAILER.size)
            r.read_into(size - TRAILER.size, [memoryview(tail)])
    except (CorruptData, ObjectMissing):
        return 0
    n, _digest, magic = TRAILER.unpack(bytes(tail))
    if magic != TRAILER_MAGIC:
        return 0
    return size - len(PACK_MAGIC) - TRAILER.size - n - pm.live_bytes - REWRITE_OVERHEAD


__all__ = ["repack", "reclaimable", "PACK_TARGET", "REWRITE_OVERHEAD"]
