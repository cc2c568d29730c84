"""kvshelf.codecs: caches <-> msgspec headers + tensors, and the portable single-file snapshot (no storage).

``default_provider.for_cache(cache).snapshot(cache)`` gives ``(CacheEntry, arrays)``;
``default_provider.for_entry(entry).load(entry, arrays)`` gives the cache back, bit-exact.
"""

from ..latent_legos.contracts import edit_epoch  # what the store may ask a live cache: whether it changed
from .checksum import array_bytes, checksum
from .codec import Codec, CodecProvider
from .header import (
    FORMAT_VERSION,
    CacheEntry,
    PageLayout,
    SnapshotHeader,
    TensorSlot,
    decode_entry,
    decode_header,
    decode_header_json,
    encode_entry,
    encode_header,
    encode_header_json,
)
from .provider import DEFAULT_PROVIDER_ID, default_provider
from .snapshot_file import Snapshot, load_snapshot, read_header, save_snapshot

__all__ = [
    "DEFAULT_PROVIDER_ID",
    "FORMAT_VERSION",
    "CacheEntry",
    "Codec",
    "CodecProvider",
    "PageLayout",
    "Snapshot",
    "SnapshotHeader",
    "TensorSlot",
    "array_bytes",
    "checksum",
    "decode_entry",
    "edit_epoch",
    "decode_header",
    "decode_header_json",
    "default_provider",
    "encode_entry",
    "encode_header",
    "encode_header_json",
    "load_snapshot",
    "read_header",
    "save_snapshot",
]
