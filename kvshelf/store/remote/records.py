"""The shared tier's index records: msgspec bodies sealed with their own checksum.

A remote record is ``xxh3_128(body) | body``: another host, a half-applied write, an eviction policy or another
application sharing the server can all leave bytes that are not what we wrote, and a hash alone (a boundary key)
must never be trusted. A record that does not unseal is ``CorruptData``; the tier drops that index entry.
"""

from __future__ import annotations

import msgspec
import numpy as np
import xxhash
from msgspec import Struct

from ...errors import CorruptData


class RemoteSummary(Struct, frozen=True, array_like=True):
    """What a lookup reads about a remote snapshot before its tokens: scope, session, length, reuse rule."""

    session_id: str
    namespace: str
    model_id: str
    length: int
    minimum_reusable_offset: int
    trimmable: bool
    nbytes: int
    created_at: float
    chunks: list[str]
    host: str = ""


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(RemoteSummary)


def seal(body: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(body) + bytes(body)


def unseal(value: bytes | None, what: str) -> memoryview:
    if value is None or len(value) < 16:
        raise CorruptData(f"remote {what} is truncated")
    view = memoryview(value)
    if xxhash.xxh3_128_digest(view[16:]) != bytes(view[:16]):
        raise CorruptData(f"remote {what} fails its checksum")
    return view[16:]


def encode_summary(s: RemoteSummary) -> bytes:
    return seal(_ENC.encode(s))


def decode_summary(value: bytes | None, what: str) -> RemoteSummary:
    body = unseal(value, what)
    try:
        return _DEC.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptData(f"remote {what} does not decode: {exc}") from None


def encode_tokens(tokens: np.ndarray) -> bytes:
    return seal(np.ascontiguousarray(tokens, dtype="<i8").tobytes())


def decode_tokens(value: bytes | None, what: str) -> np.ndarray:
    body = unseal(value, what)
    if len(body) % 8:
        raise CorruptData(f"remote {what} is not a whole number of int64 tokens")
    return np.frombuffer(body, dtype="<i8")


__all__ = ["RemoteSummary", "seal", "unseal", "encode_summary", "decode_summary", "encode_tokens", "decode_tokens"]
