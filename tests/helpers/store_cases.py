"""Shared builders for the store tests: multi-layer sessions of every latent lego, and exact comparisons."""

from __future__ import annotations

import numpy as np
from codec_cases import Case, append, bits, describe, filled, read_bits

from kvshelf import Identity, open_store
from kvshelf.codecs import CodecProvider
from kvshelf.codecs.kinds.mla import MLACodec
from kvshelf.latent_legos import MLACache

IDENTITY = Identity("test-model", config_fingerprint="cfg-1", tokenizer_hash="tok-1")
LAYERS = 2


def session(case: Case, lengths=(5, 4, 3), seed: int = 0) -> list:
    """``LAYERS`` caches of one lego, each filled by the same appends (different data per layer)."""
    return [filled(case, lengths=lengths, seed=seed + 100 * layer) for layer in range(LAYERS)]


def token_ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, size=n)]


def same_caches(a: list, b: list) -> None:
    """Bit-identical state and bookkeeping, and identical reads after the same further appends and trims."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert describe(x) == describe(y)
        batch = x.batch_size or 1
        assert read_bits(append(x, 3, 200, batch)) == read_bits(append(y, 3, 200, batch))
        assert x.trim(1) == y.trim(1)
        assert describe(x) == describe(y)


def chunk_file(store, hash_: str) -> tuple[str, int, int]:
    """(file, offset, length) of a stored chunk: its frame inside a pack (or a whole v1 blob file)."""
    name, offset, length = store.admin.chunk_location(hash_)
    return store.bytes.path(name), offset, length


def flip_chunk_byte(store, hash_: str, from_end: int = 5, bit: int = 0x40) -> None:
    """Flip one bit ``from_end`` bytes before the end of a chunk's bytes (tensor data: same size, only a hash sees)."""
    path, offset, length = chunk_file(store, hash_)
    with open(path, "r+b") as f:
        f.seek(offset + length - from_end)
        b = f.read(1)
        f.seek(offset + length - from_end)
        f.write(bytes([b[0] ^ bit]))


def open_test_store(path, **options):
    options.setdefault("chunk_tokens", 4)
    return open_store(path, identity=options.pop("identity", IDENTITY), **options)


__all__ = ["IDENTITY", "LAYERS", "session", "token_ids", "same_caches", "open_test_store", "bits", "chunk_file",
           "flip_chunk_byte"]


class RingCache(MLACache):
    """A cache kind whose prefixes are not valid states (like a wrapped rotating window): reusable only whole."""

    def is_trimmable(self) -> bool:
        return False


class RingCodec(MLACodec):
    def __init__(self):
        super().__init__(dsa=False)
        self.kind = "test-ring"

    def matches(self, cache):
        return isinstance(cache, RingCache)

    def header_trimmable(self, entry):
        return False


class PlainCodec(MLACodec):
    def __init__(self):
        super().__init__(dsa=False)

    def matches(self, cache):
        return type(cache) is MLACache


def ring_provider(name: str) -> CodecProvider:
    """A provider that stores plain ``MLACache`` and the untrimmable ``RingCache`` as two kinds."""
    return CodecProvider(name, [PlainCodec(), RingCodec()])
