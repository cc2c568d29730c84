"""The self-describing snapshot header: msgspec Structs, encoded as msgpack (index) or JSON (file metadata).

Decoding validates every type and bound, so a malformed or hostile header becomes a ``CorruptData`` (bytes that do
not decode to a header) or an ``IncompatibleFormat`` (a well-formed header of another version) before any codec or
tensor sees it. Nothing here knows a cache class; codecs give the fields meaning.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta, Struct

from ..errors import CorruptData, IncompatibleFormat

FORMAT_VERSION = 1

# Bounds keep a hostile header from asking for absurd allocations before validation reaches the tensors.
_MAX_DIM = 2**40
NonNeg = Annotated[int, Meta(ge=0, le=2**62)]
Dim = Annotated[int, Meta(ge=0, le=_MAX_DIM)]
Positive = Annotated[int, Meta(ge=1, le=_MAX_DIM)]
TokenId = Annotated[int, Meta(ge=0, le=2**62)]
TOKEN_ID_LIMIT = 2**31  # what writers (save_snapshot, the store) accept: 0 <= id < 2**31 (docs/API.md, "Input limits")
MAX_IDENTITY_CHARS = 1024  # the header's bound on model_id, config_fingerprint, tokenizer_hash, namespace
ShortStr = Annotated[str, Meta(max_length=256)]
Hex = Annotated[str, Meta(max_length=64, pattern=r"^[0-9a-f]*$")]
Scalar = str | int | float | bool | None


class TensorSlot(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tensor of an entry. ``token_axis`` is the axis where index t is cache position t (None: no such axis)."""

    name: ShortStr
    dtype: Annotated[str, Meta(max_length=32)]
    shape: list[Dim]
    token_axis: Annotated[int, Meta(ge=0, le=16)] | None
    nbytes: NonNeg
    checksum: Hex = ""


class PageLayout(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A paged row's block size, its block table (logical -> physical block) and its pool's block count."""

    block_size: Positive
    block_table: list[NonNeg]
    num_blocks: NonNeg


class CacheEntry(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One cache (one layer) of a snapshot: what it is, where it stands, and its tensors in load order.

    Fields a kind does not use stay None/default; ``extra`` lets a new kind carry scalars without a schema change.
    """

    kind: ShortStr
    offset: NonNeg
    minimum_reusable_offset: NonNeg = 0
    kv_lora_rank: Positive | None = None
    rope_head_dim: Positive | None = None
    index_head_dim: Positive | None = None
    max_tokens: Positive | None = None
    bits: Positive | None = None
    group_size: Positive | None = None
    k_bits: Positive | None = None
    v_bits: Positive | None = None
    quantized_kv_start: NonNeg = 0
    shadow: bool = False
    pages: PageLayout | None = None
    tensors: list[TensorSlot] = []
    extra: dict[ShortStr, Scalar] = {}


class SnapshotHeader(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole snapshot: who made it (provider, identity), the tokens the caches encode, one entry per cache."""

    format_version: int = FORMAT_VERSION
    provider: ShortStr
    created_at: float = 0.0
    model_id: Annotated[str, Meta(max_length=1024)] = ""
    config_fingerprint: Annotated[str, Meta(max_length=1024)] = ""
    tokenizer_hash: Annotated[str, Meta(max_length=1024)] = ""
    namespace: Annotated[str, Meta(max_length=1024)] = ""
    tokens: list[TokenId] = []
    caches: list[CacheEntry] = []


IDENTITY_FIELDS = ("model_id", "config_fingerprint", "tokenizer_hash", "namespace")


class _Version(Struct):
    """Just enough of a header to tell its version apart before trusting the rest (unknown fields ignored)."""

    format_version: int


_T = TypeVar("_T")
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()


def _decode(data: bytes, decoder_for, kind: type[_T], what: str) -> _T:
    try:
        return decoder_for(kind).decode(data)
    except msgspec.ValidationError as exc:
        raise CorruptData(f"{what} does not validate: {exc}") from None
    except (msgspec.DecodeError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise CorruptData(f"{what} does not decode ({type(exc).__name__}: {exc})") from None


def _check_version(data: bytes, decoder_for, what: str) -> None:
    version = _decode(data, decoder_for, _Version, what).format_version
    if version != FORMAT_VERSION:
        raise IncompatibleFormat(f"{what}: format_version {version} is not supported (expected {FORMAT_VERSION})")


_msgpack_decoders: dict[type, msgspec.msgpack.Decoder] = {}
_json_decoders: dict[type, msgspec.json.Decoder] = {}


def _msgpack_decoder(kind: type) -> msgspec.msgpack.Decoder:
    if kind not in _msgpack_decoders:
        _msgpack_decoders[kind] = msgspec.msgpack.Decoder(kind)
    return _msgpack_decoders[kind]


def _json_decoder(kind: type) -> msgspec.json.Decoder:
    if kind not in _json_decoders:
        _json_decoders[kind] = msgspec.json.Decoder(kind)
    return _json_decoders[kind]


def _as_bytes(data: object, what: str) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    raise CorruptData(f"{what} must be bytes (got {type(data).__name__})")


def encode_header(header: SnapshotHeader) -> bytes:
    """The header as msgpack (compact; what the store's index keeps)."""
    return _msgpack_encoder.encode(header)


def decode_header(data: bytes) -> SnapshotHeader:
    """A msgpack header, validated. Raises ``CorruptData`` or ``IncompatibleFormat`` (other version)."""
    data = _as_bytes(data, "msgpack header")
    _check_version(data, _msgpack_decoder, "msgpack header")
    return _decode(data, _msgpack_decoder, SnapshotHeader, "msgpack header")


def encode_header_json(header: SnapshotHeader) -> bytes:
    """The header as JSON (what a safetensors file carries in its text metadata)."""
    return _json_encoder.encode(header)


def decode_header_json(data: bytes | str) -> SnapshotHeader:
    """A JSON header, validated. Raises ``CorruptData`` or ``IncompatibleFormat`` (other version)."""
    data = _as_bytes(data, "JSON header")
    _check_version(data, _json_decoder, "JSON header")
    return _decode(data, _json_decoder, SnapshotHeader, "JSON header")


def encode_entry(entry: CacheEntry) -> bytes:
    """One entry as msgpack (for indexes that keep entries apart)."""
    return _msgpack_encoder.encode(entry)


def decode_entry(data: bytes) -> CacheEntry:
    """One msgpack entry, validated; malformed bytes raise ``CorruptData``."""
    return _decode(_as_bytes(data, "msgpack entry"), _msgpack_decoder, CacheEntry, "msgpack entry")


__all__ = [
    "FORMAT_VERSION",
    "IDENTITY_FIELDS",
    "TOKEN_ID_LIMIT",
    "MAX_IDENTITY_CHARS",
    "TensorSlot",
    "PageLayout",
    "CacheEntry",
    "SnapshotHeader",
    "encode_header",
    "decode_header",
    "encode_header_json",
    "decode_header_json",
    "encode_entry",
    "decode_entry",
]
