"""Who a snapshot was made for: the model, its config and its tokenizer.

Reusing KV state across any of these silently gives wrong answers (another model's caches decode to plausible
garbage, not an error), so every key the store derives
(prefix hashes, session keys, LRU order) starts with the identity key, and a store only ever sees its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import xxhash

from .inputs import check_identity_field


@dataclass(frozen=True)
class Identity:
    """The model identity a store is opened under. Empty fields are allowed but still part of the key."""

    model_id: str
    config_fingerprint: str = ""
    tokenizer_hash: str = ""

    def __post_init__(self) -> None:
        for name in ("model_id", "config_fingerprint", "tokenizer_hash"):
            check_identity_field(name, getattr(self, name))  # str, <= 1024 UTF-8 bytes, no NUL/lone surrogate

    @property
    def key(self) -> bytes:
        """16 bytes naming this identity in every index key (xxh3-128 of the three fields)."""
        return identity_key(self.model_id, self.config_fingerprint, self.tokenizer_hash)


def identity_key(model_id: str, config_fingerprint: str, tokenizer_hash: str) -> bytes:
    return xxhash.xxh3_128_digest(msgspec.msgpack.encode(["kvshelf-identity-v1", model_id, config_fingerprint,
                                                          tokenizer_hash]))


def namespace_key(identity_key_: bytes, namespace: str) -> bytes:
    """16 bytes naming (identity, namespace): the scope of sessions, prefix records and lookups."""
    return xxhash.xxh3_128_digest(identity_key_ + b"\x00ns\x00" + namespace.encode("utf-8", "surrogatepass"))


__all__ = ["Identity", "identity_key", "namespace_key"]
