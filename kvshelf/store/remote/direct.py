"""Chunk replies read straight from the socket into their destination arrays (single-server clients).

Why: through redis-py a fetched chunk is copied three times before it is an array (socket → parser buffer →
a ``bytes`` object → the destination). Here the pipelined ``GET`` replies are parsed by hand (``$<length>\\r\\n``,
then exactly that many bytes, then ``\\r\\n``): the small framing (length, descriptor) goes through a scratch buffer,
every tensor is ``recv_into`` its final place (a temporary only where the local restore would use one: a piece cut
at the prefix), and the content hash is computed over those buffers before anything is returned. Any surprise on
the wire → the connection is dropped (never returned to the pool half-read) and the error raised: a miss.
Cluster clients use the ordinary pipelined path.
"""

from __future__ import annotations

import struct

import msgspec
import xxhash

from ...errors import CorruptData
from ..objects.chunkfile import TensorInfo, storage_dtype
from .local import target_views

_DESC = msgspec.msgpack.Decoder(list[tuple[str, str, list[int]]])
MAX_DESCRIPTOR = 16 << 20


def supported(client) -> bool:
    import redis

    return type(client) is redis.Redis and client.connection_pool.connection_kwargs.get("protocol") in (None, 2)


class _Wire:
    def __init__(self, sock):
        self.sock = sock

    def exact(self, view: memoryview) -> None:
        got, n = 0, view.nbytes
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("the server closed the connection mid-reply")
            got += k

    def line(self) -> bytes:
        out = bytearray()
        while not out.endswith(b"\r\n"):
            b = self.sock.recv(1)
            if not b:
                raise ConnectionError("the server closed the connection mid-reply")
            out += b
            if len(out) > 64:
                raise CorruptData("unexpected reply framing from the server")
        return bytes(out[:-2])


class StreamChunk:
    """One ``GET`` reply being read: its descriptor parsed, its tensors read on ``read_into`` (``ChunkReader``-like,
    for ``destinations.fill_from_chunk``), its hash checked against its name before ``read_into`` returns."""

    def __init__(self, wire: _Wire, length: int, hash_: str):
        self.wire, self.hash = wire, hash_
        where = f"remote chunk {hash_}"
        if length < 4:
            raise CorruptData(f"{where} is truncated ({length} bytes)")
        head = bytearray(4)
        wire.exact(memoryview(head))
        (dlen,) = struct.unpack("<I", head)
        if dlen > min(MAX_DESCRIPTOR, length - 4):
            raise CorruptData(f"{where} is truncated inside its descriptor")
        desc = bytearray(dlen)
        wire.exact(memoryview(desc))
        self.hasher = xxhash.xxh3_128(desc)
        try:
            items = _DESC.decode(desc)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptData(f"{where}: descriptor does not decode ({exc})") from None
        tensors, at = [], 0
        for name, dtype, shape in items:
            n = 1
            for d in shape:
                n *= d
            n *= storage_dtype(dtype).itemsize
            tensors.append(TensorInfo(name, dtype, tuple(shape), at, at + n))
            at += n
        if 4 + dlen + at != length:
            raise CorruptData(f"{where}: holds {length - 4 - dlen} tensor bytes, its descriptor says {at}")
        self.tensors, self.data_bytes = tensors, at

    def read_into(self, dests):
        if len(dests) != len(self.tensors):
            raise CorruptData(f"remote chunk holds {len(self.tensors)} tensors, expected {len(dests)}")
        out = []
        for t, d in zip(self.tensors, dests):
            d = memoryview(bytearray(t.nbytes)) if d is None else d
            for v in target_views(d, t):  # one buffer, or the runs making it up
                self.wire.exact(v)
                self.hasher.update(v)
            out.append(d)
        if self.hasher.hexdigest() != self.hash:
            raise CorruptData(f"remote chunk {self.hash}: content hash does not match its name (corrupt, truncated "
                              f"or replaced)")
        return out


def fetch_into(client, keys: list[str], hashes: list[str], consume, on_batch=None) -> None:
    """Pipelined ``GET keys`` on one connection; ``consume(i, open_chunk or None)`` for each reply in order (None:
    the key is missing; ``open_chunk()`` parses the framing and returns the ``StreamChunk``, which ``consume`` must
    read fully — ``fill_from_chunk`` — before returning)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    ok = False
    try:
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
        wire = _Wire(conn._sock)
        for i, h in enumerate(hashes):
            head = wire.line()
            if head[:1] == b"-":
                raise ConnectionError(f"server error: {head[1:].decode(errors='replace')}")
            if head[:1] != b"$":
                raise CorruptData("unexpected reply framing from the server")
            length = int(head[1:])
            if length < 0:
                consume(i, None)
                continue
            consume(i, lambda h=h, length=length: StreamChunk(wire, length, h))
            tail = bytearray(2)
            wire.exact(memoryview(tail))
            if tail != b"\r\n":
                raise CorruptData("unexpected reply framing from the server")
        if on_batch is not None:
            on_batch()
        ok = True
    finally:
        if not ok:
            conn.disconnect()  # half-read replies must never reach another caller
        pool.release(conn)


__all__ = ["supported", "fetch_into", "StreamChunk"]
