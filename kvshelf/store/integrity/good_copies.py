"""Good copies: where ``repair`` finds the content of a chunk whose indexed copy failed its hash, and how it puts it
back under the same name.

Why apart from ``repair.py``: repair decides *what* to drop; this module decides whether dropping is needed at all. A
chunk is named by its content, so any copy that hashes to the name is the chunk — wherever it lies:

1. **another pack of this store.** A pack's trailer lists every chunk it holds; a chunk can lie in more than one pack
   (two saves of the same content racing, a compaction or re-encoding whose old pack still has other live chunks, a
   copy a save wrote after the damaged one was marked). Only copies other than the damaged one are tried.
2. **the shared tier** (a ``RemoteTier`` bound to the handle, or the tier named to ``repair``): its chunks are framed
   so that their hash is the local name (``remote/local.py``), so any host's upload verifies against it.

Every candidate is read in full and verified by its content hash before anything is written. A good one is stored as
a fresh one-chunk pack (durable, through the saver's ``write_pack``) and the chunk record is repointed at it in one
write transaction — the same move a re-encoding makes (``ledger.move_chunk``) — that also clears the bad mark, and
only if the record still points at the damaged copy (a save that healed it meanwhile wins; the fresh pack is then
reclaimed). Every snapshot using the chunk is healed at once; the damaged copy is dead from then on and its pack is
reclaimed with the rest of it. A dry run finds and verifies the copy and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...errors import CorruptData, KvShelfError
from ..context import StoreContext
from ..index import bad_chunks, keys, tables
from ..index.schema import ChunkRef
from ..liveness import ledger
from ..liveness.reclaim import Reclaimer
from ..liveness.save_gate import SaveGate
from ..liveness.transactions import Transactions
from ..objects.chunkfile import ChunkReader, Piece
from ..objects.protocol import open_object
from ..objects.pack import PACK_DIR, is_pack, read_trailer
from ..objects.protocol import ObjectMissing


@dataclass(frozen=True)
class Found:
    """A verified copy of a chunk: where it came from (for the report), its content, and the (object, offset) of
    the indexed copy it replaces (the one found damaged)."""

    source: str
    pieces: list[Piece]
    damaged: tuple[str, int]
    seal: Callable | None = None  # encryption at rest: the frame sealed again under the chunk's tenant key


class GoodCopies:
    """Finds and restores good copies of damaged chunks for one handle.

    ``write_pack``: the saver's (``save/saver.py``): ``[(ref, pieces)]`` -> a durable pack and where each chunk lies."""

    def __init__(self, ctx: StoreContext, txns: Transactions, gate: SaveGate, reclaimer: Reclaimer,
                 write_pack: Callable):
        self.ctx, self.txns, self.gate, self.reclaimer, self.write_pack = ctx, txns, gate, reclaimer, write_pack

    def find(self, damaged: Iterable[str], remote=None) -> dict[str, Found]:
        """A verified good copy of each chunk of ``damaged`` that has one: other packs first (one pass over their
        trailers for all of them), then ``remote`` (an object with ``good_copy(hash)``, or None)."""
        want = {h: at for h in damaged if (at := self._bad_location(h)) is not None}
        found: dict[str, Found] = {}
        if not want:
            return found
        for pack, h, offset, length in self._pack_copies(want):
            if h in found:
                continue
            got = _read_verified(self.ctx, pack, offset, length, h)
            if got is not None:
                found[h] = Found(f"pack {pack}", got[0], want[h], got[1])
        if remote is not None:
            for h in want:
                if h in found:
                    continue
                try:
                    chunk = remote.good_copy(h)
                except KvShelfError:
                    break  # the tier is unreachable: no copy from there (the report says what stays damaged)
                if chunk is not None:  # verified by its name as it was fetched (remote/local.RemoteChunk)
                    bufs = chunk.read_into([None] * len(chunk.tensors))
                    pieces = [Piece(t.name, t.dtype, t.shape, memoryview(b)) for t, b in zip(chunk.tensors, bufs)]
                    found[h] = Found(f"shared tier {getattr(remote, 'where', '')}".rstrip(), pieces, want[h])
        return found

    def restore(self, h: str, copy: Found, ref: ChunkRef) -> bool:
        """Store ``copy`` as a fresh pack and repoint chunk ``h`` at it, clearing its bad mark. False (and nothing
        changed) when the chunk is no longer indexed or no longer points at the damaged copy (a save healed it)."""
        self.ctx.check_writable("repair")
        with self.ctx.removers.removing(), self.gate.hold():  # the move frees the damaged copy (removers.py)
            name, size, placed = self.write_pack([(ref, copy.pieces)], seal=None if copy.seal is None else {
                h: copy.seal})
            _pack, offset, stored, encoding, _size = placed[h]

            def move(txn):
                meta = tables.chunk_meta(txn, h)
                if meta is None or keys.location(h, meta)[:2] != copy.damaged:
                    return None
                left = ledger.move_chunk(self.ctx.index, txn, h, name, offset, stored, encoding, size)
                bad_chunks.clear(txn, h)
                return left

            left = self.txns.write(move)
        self.reclaimer.reclaim((left or []) + [name])
        return left is not None

    def _bad_location(self, h: str) -> tuple[str, int] | None:
        """(object, offset) of the indexed copy, the one found damaged (None: no longer indexed)."""
        with self.ctx.index.read() as txn:
            meta = tables.chunk_meta(txn, h)
        return None if meta is None else keys.location(h, meta)[:2]

    def _pack_copies(self, want: dict[str, tuple[str, int]]):
        """(pack, hash, offset, length) of every copy of a wanted chunk other than its damaged one."""
        for name in sorted(self.ctx.bytes.names(PACK_DIR)):
            if not is_pack(name):
                continue
            try:
                with open_object(self.ctx.bytes, name) as reader:
                    contents = read_trailer(reader, name)
            except (CorruptData, ObjectMissing, OSError):
                continue  # a damaged trailer lists nothing we could trust; verify reports it
            for h, offset, length, _encoding in contents.chunks:
                if want.get(h, (name, offset)) != (name, offset):
                    yield name, h, offset, length


def _read_verified(ctx: StoreContext, pack: str, offset: int, length: int, h: str):
    """The chunk at (pack, offset, length) as (pieces, its re-sealing or None), or None when that copy does not hash
    to ``h`` either."""
    try:
        with ChunkReader(None, h, source=open_object(ctx.bytes, pack), base=offset, length=length,
                         where=f"{h} in {pack}", owns_source=True, keys=ctx.keys, name=h) as reader:
            bufs = reader.read_into([None] * len(reader.tensors))
            pieces = [Piece(t.name, t.dtype, t.shape, b) for t, b in zip(reader.tensors, bufs)]
            if not reader.sealed:
                return pieces, None
            tkey, content = ctx.keys.by_id(reader.kid), reader.expect_hash
            return pieces, lambda frame: [tkey.seal(h, content, frame)]
    except (CorruptData, ObjectMissing, OSError):
        return None


__all__ = ["Found", "GoodCopies"]
