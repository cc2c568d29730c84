"""Everything the shared tier needs from the local store, in one module: it reads the handle's context (``ctx``:
identity, provider, index, byte store), never a ``Store``.

Two directions:

* out: ``chunk_buffers(ctx, hash)`` — a committed chunk's *logical content* read back from the local store (under a
  lease, hash-verified by the local reader), framed as the remote value ``u32 descriptor length | descriptor | tensor
  bytes``. The descriptor is the one the local content hash starts with, so ``xxh3_128(value[4:])`` *is* the local
  chunk hash: any host verifies a remote chunk with the name it already has.
* in: ``RemoteChunk`` — a fetched value parsed and verified (length, descriptor, hash) and handed to the local
  restore machinery (``destinations.fill_from_chunk`` into ``Destinations``), and ``build_caches`` — the codec load of a
  snapshot cut to ``p`` from verified chunks, exactly as a local restore does it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

import msgspec
import xxhash

from ...errors import CorruptData, EncryptionKeyError, IdentityMismatch, InvalidCacheState
from ..objects.chunkfile import TensorInfo, descriptor, storage_dtype
from ..objects.sealing import is_sealed
from ..context import StoreContext
from ..index.schema import ChunkRef, Manifest
from ..prefix.hashing import tokens_array
from ..restore.chunks import open_chunk
from ..restore.destinations import Destinations, fill_from_chunk

_DESC = msgspec.msgpack.Decoder(list[tuple[str, str, list[int]]])


def chunk_buffers(ctx: StoreContext, hash_: str) -> list[bytes | memoryview]:
    """The remote value of one local chunk (see the module docstring); the caller holds a lease on it."""
    with open_chunk(ctx.index, ctx.bytes, hash_, verify=True, keyring=ctx.keys) as reader:
        bufs = reader.read_into([None] * len(reader.tensors))
        desc = descriptor(reader.tensors)
        value = [struct.pack("<I", len(desc)), desc, *bufs]
        if reader.sealed:  # encryption at rest: the tier holds only sealed values, under the chunk's tenant key
            return [ctx.keys.by_id(reader.kid).seal(hash_, reader.expect_hash, value)]
    return value


def unique_refs(manifest: Manifest) -> list[ChunkRef]:
    return list({r.hash: r for r in manifest.all_chunks}.values())


def needed_refs(manifest: Manifest, p: int) -> list[ChunkRef]:
    """The chunks a restore of the first ``p`` tokens reads (as the local restore: ``start < p`` plus own)."""
    return [r for r in manifest.chunks if r.start < p] + list(manifest.own)


class RemoteChunk:
    """A fetched chunk value, verified before anything reads it; quacks like ``ChunkReader`` for ``fill_from_chunk``."""

    def __init__(self, value: bytes | None, hash_: str, keys=None):
        where = f"remote chunk {hash_}"
        if value is None:
            raise CorruptData(f"{where} is missing")
        view = memoryview(value)
        content = hash_
        if is_sealed(view):  # opened under its tenant's key: then the content hash inside is what the bytes hash to
            if keys is None:
                raise EncryptionKeyError(f"{where} is sealed (encryption at rest): reading it needs the store's key")
            content, view = keys.open_chunk(hash_, view, where)
        if len(view) < 4:
            raise CorruptData(f"{where} is truncated ({len(view)} bytes)")
        (dlen,) = struct.unpack_from("<I", view, 0)
        if 4 + dlen > len(view):
            raise CorruptData(f"{where} is truncated inside its descriptor")
        if xxhash.xxh3_128_hexdigest(view[4:]) != content:
            raise CorruptData(f"{where}: content hash does not match its name (corrupt, truncated or replaced)")
        try:
            items = _DESC.decode(view[4:4 + dlen])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptData(f"{where}: descriptor does not decode ({exc})") from None
        tensors, at = [], 0
        for name, dtype, shape in items:
            n = math.prod(shape) * storage_dtype(dtype).itemsize
            tensors.append(TensorInfo(name, dtype, tuple(shape), at, at + n))
            at += n
        if 4 + dlen + at != len(view):
            raise CorruptData(f"{where}: holds {len(view) - 4 - dlen} tensor bytes, its descriptor says {at}")
        self.tensors, self.data_bytes = tensors, at
        self._data = view[4 + dlen:]

    def read_into(self, dests):
        if len(dests) != len(self.tensors):
            raise CorruptData(f"remote chunk holds {len(self.tensors)} tensors, expected {len(dests)}")
        out = []
        for t, d in zip(self.tensors, dests):
            src = self._data[t.start:t.stop]
            if d is None:
                out.append(src)
                continue
            views = target_views(d, t)
            at = 0
            for v in views:
                v[:] = src[at:at + v.nbytes]
                at += v.nbytes
            out.append(d)
        return out


def target_views(d, t: TensorInfo) -> list[memoryview]:
    """A destination (one buffer, or the runs making it up in C order) as byte views, checked against ``t``."""
    views = [v.cast("B") for v in d] if isinstance(d, list) else [d.cast("B")]
    if sum(v.nbytes for v in views) != t.nbytes:
        raise CorruptData(f"remote chunk tensor {t.name!r} holds {t.nbytes} bytes, expected "
                          f"{sum(v.nbytes for v in views)}")
    return views


def check_manifest(ctx: StoreContext, manifest: Manifest, namespace: str, p: int | None) -> int:
    """The cut to restore (``p`` or the whole snapshot), refusing another identity or an illegal cut."""
    for field in ("model_id", "config_fingerprint", "tokenizer_hash"):
        stored, expected = getattr(manifest, field), getattr(ctx.identity, field)
        if stored != expected:
            raise IdentityMismatch(field, stored, expected, f"remote snapshot {manifest.snapshot_id}")
    if manifest.namespace != namespace:
        raise IdentityMismatch("namespace", manifest.namespace, namespace, f"remote snapshot {manifest.snapshot_id}")
    ctx.provider.check_provider(manifest.provider)
    for entry in manifest.entries:  # a kind this host cannot load is refused before any chunk is fetched
        ctx.provider.for_entry(entry)
    p = manifest.length if p is None else int(p)
    if not 0 <= p <= manifest.length or (p < manifest.length and (not manifest.trimmable or
                                                                  p < manifest.minimum_reusable_offset)):
        raise InvalidCacheState(f"remote snapshot {manifest.snapshot_id} of {manifest.length} tokens cannot be cut "
                                f"to {p}")
    return p


def build_caches(ctx: StoreContext, manifest: Manifest, p: int, fill) -> list:
    """The caches of ``manifest`` cut to ``p`` (as a local restore builds them): ``fill(dest, by_hash)`` fills
    ``Destinations`` from verified chunks, ``by_hash`` = every distinct needed hash -> the ranges holding it."""
    entries = list(manifest.entries)
    if p < manifest.length:
        entries = [ctx.provider.for_entry(e).prefix_entry(e, p) for e in entries]
    dest = Destinations(entries)
    by_hash: dict[str, list[ChunkRef]] = {}
    for ref in needed_refs(manifest, p):
        by_hash.setdefault(ref.hash, []).append(ref)
    fill(dest, by_hash)
    return [ctx.provider.for_entry(e).load(e, a, verify=False) for e, a in zip(entries, dest.finish())]


def fill_from(chunks: Iterable[tuple[str, RemoteChunk]]):
    """A ``fill`` for ``build_caches`` from ``(hash, RemoteChunk)`` pairs arriving in any order."""

    def fill(dest, by_hash) -> None:
        left = dict(by_hash)
        for hash_, chunk in chunks:
            for ref in left.pop(hash_, []):
                fill_from_chunk(chunk, ref, dest)
        if left:
            raise CorruptData(f"remote chunks {sorted(left)} never arrived")

    return fill


def fill_one(reader, ref: ChunkRef, dest) -> int:
    """One chunk (a ``RemoteChunk`` or a ``direct.StreamChunk``) into its place in ``dest``."""
    return fill_from_chunk(reader, ref, dest)


__all__ = ["tokens_of", "chunk_buffers", "unique_refs", "needed_refs", "RemoteChunk", "check_manifest", "build_caches",
           "fill_from", "fill_one"]


def tokens_of(manifest: Manifest):
    """The snapshot's tokens as int64 (what the boundary hashes and the token records are computed from)."""
    return tokens_array(manifest.tokens)
