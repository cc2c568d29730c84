"""What the index keeps about each snapshot and chunk: msgspec Structs, stored as msgpack.

The full ``Manifest`` is also written beside the chunks (in its pack's trailer; layout v1: ``blobs/manifests/<id>.msgpack``,
sealed by ``integrity/legacy_v1.py`` when a v2 store opens it) so that the index can be rebuilt from the objects alone. ``Summary`` is the small per-snapshot record lookups and eviction read; the
manifest proper (with every cache entry) is decoded only on restore.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
import xxhash
from msgspec import Meta, Struct

from ...codecs.header import CacheEntry
from ...errors import CorruptData, IncompatibleFormat

MANIFEST_VERSION = 1
NonNeg = Annotated[int, Meta(ge=0, le=2**62)]
HexId = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]


class ChunkRef(Struct, frozen=True, array_like=True):
    """One chunk a snapshot reads: content hash, the token range it covers ([0, 0) for untokened tensors), bytes."""

    hash: HexId
    start: NonNeg
    stop: NonNeg
    nbytes: NonNeg



BlobRef = ChunkRef  # the name before the store said "chunk" for one thing; exported for callers

class Manifest(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything needed to restore a snapshot and to re-index it after the index is lost."""

    format_version: int = MANIFEST_VERSION
    snapshot_id: HexId
    session_id: Annotated[str, Meta(max_length=1024)]
    namespace: Annotated[str, Meta(max_length=1024)] = ""
    model_id: str
    config_fingerprint: str = ""
    tokenizer_hash: str = ""
    provider: str
    tokens: list[NonNeg]
    entries: list[CacheEntry]
    chunk_tokens: Annotated[int, Meta(ge=1)]
    chunks: list[ChunkRef]
    own: list[ChunkRef] = []
    created_at: float = 0.0
    minimum_reusable_offset: NonNeg = 0
    trimmable: bool = True

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def all_chunks(self) -> list[ChunkRef]:
        """Every chunk the snapshot reads: its token-range ``chunks`` and its untokened ``own`` ones."""
        return [*self.chunks, *self.own]

    blobs = all_chunks  # the name before the store said "chunk" for one thing; kept for callers

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.all_chunks)


class Summary(Struct, frozen=True, array_like=True):
    """The small per-snapshot record: scope, session, length, reuse floor, trimmability, bytes, times."""

    id_key: bytes
    ns_key: bytes
    session_id: str
    namespace: str
    length: int
    minimum_reusable_offset: int
    trimmable: bool
    nbytes: int
    created_at: float
    last_used_ns: int
    pack: str = ""  # the pack whose trailer holds this snapshot's manifest ("": a v1 manifest file)


class ChunkMeta(Struct, frozen=True, array_like=True):
    """Per chunk: how many manifests reference it, payload bytes, bytes on disk, encoding, last use, and where it
    lies: ``stored_bytes`` at ``offset`` in ``pack`` ("": a v1 chunk file file ``blobs/<hh>/<hash>.<ext>``)."""

    refs: int
    nbytes: int
    stored_bytes: int
    encoding: str
    last_used_ns: int
    pack: str = ""
    offset: int = 0


class PackMeta(Struct, frozen=True, array_like=True):
    """Per pack: live chunks and their bytes, the pack's size, and how many indexed snapshots' manifests it holds
    (a pack may go only when both counts are zero; compaction rewrites packs whose live ratio fell)."""

    live_chunks: int
    live_bytes: int
    size: int
    manifests: int


class Lease(Struct, frozen=True, array_like=True):
    """A reader's claim: these chunks, and the objects (packs, v1 chunk files) they lie in, must not be unlinked or
    rewritten before ``expires`` while the lease file holding it is locked (``leases.py``; ``pid`` is information)."""

    pid: int
    expires: float
    snapshot_id: str
    hashes: list[str]
    objects: list[str] = []


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}
_SEALED = 0xC1  # the one byte msgpack never emits: marks a checksummed record (v1 records are bare msgpack)


def encode(obj: Struct) -> bytes:
    """msgpack behind a tag byte and its xxh3-64, so a flipped index byte is caught where the record is read."""
    body = _encoder.encode(obj)
    return bytes([_SEALED]) + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body


def is_sealed(data: bytes | memoryview) -> bool:
    """Whether a record carries the seal (tag byte + checksum); bare v1 msgpack does not."""
    return len(data) > 0 and data[0] == _SEALED


def unseal(data: bytes | memoryview, what: str) -> bytes | memoryview:
    """The msgpack body of a record: checksum checked for sealed (v2) records, v1 records passed as they are."""
    if len(data) and data[0] == _SEALED:
        body = data[9:]
        if len(data) < 9 or xxhash.xxh3_64_intdigest(body) != int.from_bytes(data[1:9], "little"):
            raise CorruptData(f"{what} fails its checksum (a damaged index record)")
        return body
    return data


def seal_tokens(tokens: np.ndarray) -> bytes:
    """A tokens record: the little-endian int64 ids, then the tag byte and their xxh3-64. Its length is 8n + 9,
    never a multiple of 8, so a v1 record (bare ids, 8n bytes) is told apart by its length alone."""
    body = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    return body + bytes([_SEALED]) + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def tokens_of(data: bytes | memoryview, what: str) -> np.ndarray:
    """The token ids of a tokens record, checksum checked (``CorruptData`` naming ``what`` when it fails)."""
    n = len(data)
    if n % 8 == 0:
        return np.frombuffer(data, dtype="<i8")  # a v1 record
    body = data[:n - 9]
    if n % 8 != 1 or data[n - 9] != _SEALED or \
            xxhash.xxh3_64_intdigest(body) != int.from_bytes(data[n - 8:], "little"):
        raise CorruptData(f"{what} fails its checksum (a damaged index record)")
    return np.frombuffer(body, dtype="<i8")


def decode(data: bytes | memoryview, kind: type, what: str):
    decoder = _decoders.get(kind) or _decoders.setdefault(kind, msgspec.msgpack.Decoder(kind))
    try:
        obj = decoder.decode(unseal(data, what))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise CorruptData(f"{what} does not decode as a {kind.__name__}: {exc}") from None
    if kind is Manifest and obj.format_version != MANIFEST_VERSION:
        raise IncompatibleFormat(f"{what}: manifest format_version {obj.format_version} is not supported "
                                 f"(expected {MANIFEST_VERSION})")
    return obj


__all__ = ["BlobRef", "ChunkRef", "Manifest", "Summary", "ChunkMeta", "PackMeta", "Lease", "unseal", "is_sealed", "encode", "decode",
           "seal_tokens", "tokens_of", "MANIFEST_VERSION"]
