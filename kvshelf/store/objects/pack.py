"""The pack: one object per save holding that save's new chunks back to back, and its manifest in the trailer.

Why: a durable save then costs one data pass, one fsync and one directory fsync for all its chunks (v1 paid both per
chunk and once more for a separate manifest file), and ``rebuild_index`` still finds every manifest on disk.

Layout (``packs/<snapshot id>.pack`` for a save; see ``new_pack_name``)::

    b"KVSHPK2\\n"
    chunk frames, back to back: each exactly a v1 chunk file (``u64 len | safetensors JSON | tensor bytes``, or its
                                zstd twin), readable on its own at (pack, offset, length)
    manifest (msgpack; the snapshot this save committed; empty for packs written by tools)
    u64 manifest length | u64 xxh3-64 of the manifest | b"KVSHPKT\\n"

Chunks stay content-addressed by xxh3-128 over their logical content (``chunkfile.content_hash``), so a pack chunk and
a v1 chunk file of the same content have the same name and deduplicate against each other.
"""

from __future__ import annotations

import struct
import time
import uuid

import msgspec
import xxhash

from ...errors import CorruptData

PACK_MAGIC = b"KVSHPK2\n"
TRAILER_MAGIC = b"KVSHPKT\n"
TRAILER = struct.Struct("<QQ8s")
PACK_DIR = "packs/"
TOMB_DIR = "tomb/"


def new_pack_name(snapshot_id: str = "", rewrite: bool = False) -> str:
    """``packs/<snapshot id>.pack`` for the pack of a save (named after the snapshot it commits),
    ``packs/<snapshot id>-<uuid>.pack`` for a rewritten manifest of that snapshot, ``packs/<uuid>.pack`` else."""
    if snapshot_id:
        return f"{PACK_DIR}{snapshot_id}{'-' + uuid.uuid4().hex[:12] if rewrite else ''}.pack"
    return f"{PACK_DIR}{uuid.uuid4().hex}.pack"


def tomb(sid_hex: str, quarantined: bool = False) -> str:
    """The object name of a removed snapshot's tombstone (``integrity/tombs.py``)."""
    return f"{TOMB_DIR}{sid_hex}{'.quarantined' if quarantined else ''}"


def is_pack(name: str) -> bool:
    return name.startswith(PACK_DIR) and name.endswith(".pack")


class PackBuilder:
    """Collects chunk frames (lists of buffers, never joined) and records where each one will lie."""

    def __init__(self) -> None:
        self.buffers: list = [PACK_MAGIC]
        self.size = len(PACK_MAGIC)
        self.where: dict[str, tuple[int, int, str]] = {}

    def add(self, hash_: str, frame: list, encoding: str = "raw", keep: bool = True) -> None:
        n = sum(memoryview(b).nbytes for b in frame)
        self.where[hash_] = (self.size, n, encoding)
        if keep:
            self.buffers.extend(frame)
        self.size += n

    def finish(self, manifest: bytes) -> list:
        """Every buffer of the pack, trailer included."""
        return [*self.buffers, *self.trailer(manifest)]

    def trailer(self, manifest: bytes) -> list:
        """The trailer's buffers (for a pack streamed frame by frame: ``add(..., keep=False)``)."""
        table = [[h, off, n, enc] for h, (off, n, enc) in self.where.items()]
        body = msgspec.msgpack.encode([manifest, time.time_ns(), table])
        return [body, TRAILER.pack(len(body), xxhash.xxh3_64_intdigest(body), TRAILER_MAGIC)]


class PackContents(msgspec.Struct, array_like=True):
    manifest: bytes
    written_ns: int
    chunks: list[tuple[str, int, int, str]]


def read_trailer(reader, where: str) -> PackContents:
    """A pack's trailer (checksum checked): its manifest, when it was written, where its chunks lie;
    ``CorruptData`` when the trailer is damaged."""
    size = reader.size()
    if size < len(PACK_MAGIC) + TRAILER.size:
        raise CorruptData(f"pack {where} is truncated ({size} bytes)")
    tail = bytearray(TRAILER.size)
    reader.read_into(size - TRAILER.size, [memoryview(tail)])
    n, digest, magic = TRAILER.unpack(bytes(tail))
    if magic != TRAILER_MAGIC or n > size - TRAILER.size - len(PACK_MAGIC):
        raise CorruptData(f"pack {where} has no valid trailer (truncated or overwritten)")
    raw = bytearray(n)
    reader.read_into(size - TRAILER.size - n, [memoryview(raw)])
    if xxhash.xxh3_64_intdigest(bytes(raw)) != digest:
        raise CorruptData(f"pack {where}: its trailer fails its checksum")
    try:
        return msgspec.msgpack.decode(bytes(raw), type=PackContents)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptData(f"pack {where}: its trailer does not decode ({exc})") from None


__all__ = ["PACK_DIR", "PACK_MAGIC", "PackBuilder", "TOMB_DIR", "is_pack", "new_pack_name", "tomb", "read_trailer", "PackContents"]
