"""The chunk chunk format: a standard safetensors file we frame ourselves, or its zstd-compressed twin (``.kvz``).

A chunk is named by its *content hash*: xxh3-128 over a msgpack descriptor of its tensors (name, dtype, shape, in file
order) followed by the tensors' bytes. The hash covers the logical content, not the file, so a compressed chunk keeps
its name and manifests never change when a chunk is recompressed.

Raw form: ``u64 header length | JSON header (padded with spaces to 8 bytes) | tensor bytes`` — readable by any
safetensors reader (``mx.load`` included). We write it with ``os.writev`` over zero-copy views of the MLX arrays and
read tensor bytes with ``preadv`` straight into the caller's destination buffers, hashing from there.

Compressed form (``.kvz``): ``b"KVSHZ01\\n" | u64 header length | the same JSON header | one zstd frame`` whose
content is the tensor bytes with float tensors byte-shuffled (plane k holds byte k of every element), which is what
makes KV floats compress (``shuffle.py``).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import msgspec
import numpy as np
import xxhash
import zstandard

from ...codecs.dtypes import DTYPE_NAMES, numpy_dtype, safetensors_code
from ...errors import CorruptData, EncryptionKeyError
from .runhash import RunHash
from .sealing import SEAL_MAGIC, is_sealed
from .shuffle import shuffle, shuffle_itemsize, unshuffle_into

KVZ_MAGIC = b"KVSHZ01\n"
MAX_HEADER = 64 << 20
_IO_MAX = 0x7FFFF000
_IOV_MAX = 1024  # POSIX minimum of IOV_MAX on Linux
_JSON = msgspec.json.Decoder()
_JSON_OUT = msgspec.json.Encoder()

# mlx dtype name -> (safetensors code, numpy storage dtype): the codecs' table, so the two formats never disagree
DTYPES: dict[str, tuple[str, np.dtype]] = {name: (safetensors_code(name), numpy_dtype(name)) for name in DTYPE_NAMES}
_FROM_CODE = {code: name for name, (code, _) in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a chunk: logical name, mlx dtype name, shape, byte range within the tensor data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Piece:
    """A tensor to be written: name, mlx dtype name, shape, and its C-order bytes — one zero-copy view, or the
    list of contiguous runs it is made of (a ``[1, H, t, D]`` token window of a ``[1, H, T, D]`` plane is H runs),
    which are hashed and ``pwritev``-ed as they lie, never joined."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview | list[memoryview]

    @property
    def segments(self) -> list[memoryview]:
        return self.data if isinstance(self.data, list) else [self.data]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.data) if isinstance(self.data, list) else self.data.nbytes

    def contiguous(self) -> memoryview:
        if not isinstance(self.data, list):
            return self.data
        return self.data[0] if len(self.data) == 1 else memoryview(b"".join(self.data))


def axis_window(host: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    """The view of ``host`` covering positions ``[start, stop)`` of ``axis`` (a chunk's token window)."""
    return host[(slice(None),) * axis + (slice(start, stop),)]


def storage_dtype(dtype: str) -> np.dtype:
    try:
        return DTYPES[dtype][1]
    except KeyError:
        raise CorruptData(f"unsupported tensor dtype {dtype!r}") from None


def descriptor(items) -> bytes:
    return msgspec.msgpack.encode([[t.name, t.dtype, list(t.shape)] for t in items])


SMALL_RUNS = 32 << 10  # average run size below which a chunk is hashed with the GIL held (see content_hash)


def content_hash(pieces: list[Piece], desc: bytes | None = None) -> str:
    """The chunk's name: xxh3-128 over the descriptor (``desc``, when the caller has it already) and then every
    tensor's bytes, in order."""
    segments = [seg for p in pieces for seg in p.segments]
    head = descriptor(pieces) if desc is None else desc
    # same digest either way: many small runs (encoded formats' scales, ~1-8 KiB) hash fastest through the xxhash
    # object (0.1 us a call, holding the GIL for as long); runs of 64 KiB and more go through xxh3's C API with the
    # GIL released (1.6 us a call), so the save's writer thread never waits for the GIL behind the hash
    small = len(segments) > 0 and sum(s.nbytes for s in segments) < SMALL_RUNS * len(segments)
    h = xxhash.xxh3_128(head) if small else RunHash(head)
    for seg in segments:
        h.update(seg)
    return h.hexdigest()


def frame_header(pieces: list[Piece], metadata: dict[str, str]) -> bytes:
    """The safetensors JSON header (8-byte aligned) for ``pieces`` laid out back to back in order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for p in pieces:
        n = p.nbytes
        header[p.name] = {"dtype": DTYPES[p.dtype][0], "shape": list(p.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = _JSON_OUT.encode(header)  # compact UTF-8 JSON (as safetensors reads it), 15x cheaper than json.dumps
    return raw + b" " * (-len(raw) % 8)


def raw_buffers(pieces: list[Piece], metadata: dict[str, str]) -> list[memoryview | bytes]:
    header = frame_header(pieces, metadata)
    return [struct.pack("<Q", len(header)), header, *(seg for p in pieces for seg in p.segments if seg.nbytes)]


def kvz_buffers(pieces: list[Piece], metadata: dict[str, str], level: int = 3) -> list[bytes]:
    header = frame_header(pieces, metadata)
    total = sum(p.nbytes for p in pieces)
    compressor = zstandard.ZstdCompressor(level=level)
    chunker = compressor.chunker(size=total, chunk_size=1 << 20)
    out = [KVZ_MAGIC, struct.pack("<Q", len(header)), header]
    for p in pieces:
        out.extend(chunker.compress(shuffle(p.contiguous(), shuffle_itemsize(p.dtype))))
    out.extend(chunker.finish())
    return out


def _parse_header(raw: bytes, where: str) -> tuple[list[TensorInfo], dict[str, str]]:
    try:
        header = _JSON.decode(raw)  # msgspec: ~3x faster than json on these many-tensor headers
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        metadata = header.pop("__metadata__", {}) or {}
        infos = []
        for name, spec in header.items():
            code, shape, (start, stop) = spec["dtype"], tuple(int(d) for d in spec["shape"]), spec["data_offsets"]
            dtype = _FROM_CODE[code]
            if math.prod(shape) * DTYPES[dtype][1].itemsize != stop - start or start < 0:
                raise ValueError(f"tensor {name!r} byte range does not match its shape")
            infos.append(TensorInfo(name, dtype, shape, int(start), int(stop)))
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptData(f"chunk {where}: safetensors header is malformed ({exc})") from None
    infos.sort(key=lambda t: t.start)
    expected = 0
    for t in infos:
        if t.start != expected:
            raise CorruptData(f"chunk {where}: tensor {t.name!r} does not follow the previous one")
        expected = t.stop
    return infos, metadata


class MemorySource:
    """A ranged source over bytes in memory (a sealed chunk's plaintext), as ``LocalReader`` reads a file."""

    def __init__(self, data: memoryview):
        self.data = data

    def read_into(self, offset: int, buffers) -> None:
        for b in buffers:
            n = b.nbytes
            if offset + n > len(self.data):
                raise CorruptData("read past the end of an in-memory chunk")
            b.cast("B")[:] = self.data[offset:offset + n]
            offset += n

    def size(self) -> int:
        return len(self.data)

    def close(self) -> None:
        self.data = memoryview(b"")


class ChunkReader:
    """An open chunk — a whole v1 chunk file file, or ``length`` bytes at ``base`` inside a pack — read through a ranged
    source (``read_into(offset, buffers)``): its tensors, and ``read_into`` that fills caller buffers and checks the
    content hash. ``ChunkReader(path)`` opens a file by path (v1 chunk files, tools)."""

    def __init__(self, path: str | None = None, expect_hash: str | None = None, *, source=None, base: int = 0,
                 length: int | None = None, where: str | None = None, owns_source: bool | None = None,
                 keys=None, name: str | None = None):
        self.path, self.expect_hash = path, expect_hash
        # a sealed chunk (sealing.py) is opened with ``keys`` (the store's ``KeyRing``) under its ``name``; then it
        # reads from its plaintext in memory, and ``expect_hash`` becomes the content hash sealed inside
        self.keys, self.name, self.sealed = keys, name or expect_hash, False
        self.where = where or (os.path.basename(path) if path else "chunk")
        if source is None:
            from .local import LocalReader

            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise CorruptData(f"chunk {self.where} is missing") from None
            source = LocalReader(fd, self.where)
            owns_source = True if owns_source is None else owns_source
        self.source, self.base, self._owns = source, base, bool(owns_source)
        self.length = length
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _pread(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        try:
            self.source.read_into(offset, [memoryview(buf)])
        except CorruptData:
            raise CorruptData(f"chunk {self.where} is truncated") from None
        return bytes(buf)

    def _open(self) -> None:
        where = self.where
        if self.length is None:
            self.length = self.source.size() - self.base
        if self.length < 16:
            raise CorruptData(f"chunk {where} is truncated ({self.length} bytes)")
        head = self._pread(self.base, 16)
        if is_sealed(head):
            head = self._unseal(where)
        self.compressed = head[:8] == KVZ_MAGIC
        at = 8 if self.compressed else 0
        (hlen,) = struct.unpack("<Q", head[at:at + 8])
        if hlen > MAX_HEADER or at + 8 + hlen > self.length:
            raise CorruptData(f"chunk {where}: header length {hlen} is implausible (or the chunk is truncated)")
        raw = self._pread(self.base + at + 8, hlen)
        self.tensors, self.metadata = _parse_header(raw, where)
        self.data_start = self.base + at + 8 + hlen
        self.data_bytes = self.tensors[-1].stop if self.tensors else 0
        if not self.compressed and self.data_start + self.data_bytes > self.base + self.length:
            raise CorruptData(f"chunk {where} is truncated (tensor data ends early)")

    def _unseal(self, where: str) -> bytes:
        """Open the sealed envelope and read on from its plaintext; the first 16 bytes of the plain frame."""
        if self.keys is None or self.name is None:
            raise EncryptionKeyError(f"chunk {where} is sealed (encryption at rest): reading it needs the store's key")
        blob = bytearray(self.length)  # read once, opened in place of a copy
        try:
            self.source.read_into(self.base, [memoryview(blob)])
        except CorruptData:
            raise CorruptData(f"chunk {where} is truncated") from None
        self.kid = bytes(blob[len(SEAL_MAGIC):len(SEAL_MAGIC) + 16])
        content, plain = self.keys.open_chunk(self.name, blob, where)
        if self.expect_hash is not None:
            self.expect_hash = content
        if self._owns:
            self.source.close()
        self.source, self.base, self.length, self._owns, self.sealed = MemorySource(plain), 0, len(plain), False, True
        if self.length < 16:
            raise CorruptData(f"chunk {where} is truncated ({self.length} bytes inside its seal)")
        return self._pread(0, 16)

    def close(self) -> None:
        if self._owns and self.source is not None:
            self.source.close()
        self.source = None

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_into(self, dests: list[memoryview | list[memoryview] | None]) -> list[memoryview | list[memoryview]]:
        """Fill one destination per tensor (a buffer, a list of runs making it up in C order, or None: a fresh
        buffer) and verify the content hash over them, each tensor hashed right after it was read (still hot)."""
        where = self.where
        if len(dests) != len(self.tensors):
            raise CorruptData(f"chunk {where} holds {len(self.tensors)} tensors, expected {len(dests)}")
        bufs = []
        for t, d in zip(self.tensors, dests):
            d = memoryview(bytearray(t.nbytes)) if d is None else d
            views = [v.cast("B") for v in d] if isinstance(d, list) else [d.cast("B")]
            if sum(v.nbytes for v in views) != t.nbytes:
                raise CorruptData(f"chunk {where}: tensor {t.name!r} holds {t.nbytes} bytes, expected "
                                  f"{sum(v.nbytes for v in views)}")
            bufs.append(views)
        h = xxhash.xxh3_128(descriptor(self.tensors)) if self.expect_hash is not None else None
        if self.compressed:
            self._decompress_into(bufs, where)
            if h is not None:
                for views in bufs:
                    for v in views:
                        h.update(v)
        else:
            for t, views in zip(self.tensors, bufs):
                try:
                    self.source.read_into(self.data_start + t.start, views)
                except CorruptData:
                    raise CorruptData(f"chunk {where} is truncated (tensor data ends early)") from None
                if h is not None:
                    for v in views:
                        h.update(v)
        if h is not None:
            got = h.hexdigest()
            if got != self.expect_hash:
                raise CorruptData(f"chunk {where}: content hash {got} does not match its name {self.expect_hash}")
        return [views if isinstance(d, list) else views[0] for d, views in zip(dests, bufs)]

    def _decompress_into(self, bufs: list[list[memoryview]], where: str) -> None:
        size = self.base + self.length - self.data_start
        frame = bytearray(size)
        try:
            self.source.read_into(self.data_start, [memoryview(frame)])
        except CorruptData:
            raise CorruptData(f"chunk {where} is truncated (compressed data ends early)") from None
        try:
            payload = zstandard.ZstdDecompressor().decompress(bytes(frame), max_output_size=self.data_bytes)
        except zstandard.ZstdError as exc:
            raise CorruptData(f"chunk {where}: compressed data does not decode ({exc})") from None
        if len(payload) != self.data_bytes:
            raise CorruptData(f"chunk {where}: compressed data holds {len(payload)} bytes, expected {self.data_bytes}")
        view = memoryview(payload)
        for t, views in zip(self.tensors, bufs):
            if len(views) == 1:
                unshuffle_into(view[t.start:t.stop], views[0], shuffle_itemsize(t.dtype))
            else:
                tmp = memoryview(bytearray(t.nbytes))
                unshuffle_into(view[t.start:t.stop], tmp, shuffle_itemsize(t.dtype))
                at = 0
                for v in views:
                    v[:] = tmp[at:at + v.nbytes]
                    at += v.nbytes


__all__ = ["TensorInfo", "Piece", "ChunkReader", "axis_window", "content_hash", "descriptor", "raw_buffers", "kvz_buffers",
           "storage_dtype", "DTYPES", "KVZ_MAGIC"]
