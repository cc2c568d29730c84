"""The provider: exactly-one matching, lookup by kind, the id check, and a new kind joining without store changes."""

from __future__ import annotations

import mlx.core as mx
import pytest
from codec_cases import CASES_BY_ID, filled

from kvshelf.codecs import CacheEntry, Codec, CodecProvider, default_provider
from kvshelf.codecs.kinds.latent_common import make_slots, prefix_tensors, replace_entry
from kvshelf.codecs.validate import SlotSpec, check_arrays, check_slots, incompatible
from kvshelf.errors import IncompatibleFormat


class ToyCache:
    """A cache kind the library does not know: bfloat16 values ``[1, T, 3]``."""

    def __init__(self, values: mx.array) -> None:
        self.values = values

    @property
    def offset(self) -> int:
        return self.values.shape[1]

    batch_size = 1

    def signature(self) -> str:
        return "toy:bf16"


class ToyCodec:
    kind = "toy-bf16"

    def matches(self, cache) -> bool:
        return isinstance(cache, ToyCache)

    def snapshot(self, cache, *, checksums=True):
        slots = make_slots([("values", cache.values, 1)], checksums)
        return CacheEntry(kind=self.kind, offset=cache.offset, tensors=slots), [cache.values]

    def validate(self, entry, index=None):
        if entry.kind != self.kind:
            raise incompatible(entry, index, "kind", "not a toy")
        check_slots(entry, index, [SlotSpec("values", "bfloat16", (1, entry.offset, 3), 1)])

    def load(self, entry, arrays, *, verify=True, index=None):
        self.validate(entry, index)
        check_arrays(entry, index, arrays, verify)
        return ToyCache(arrays[0])

    def load_batch(self, entries, arrays_per_row, *, verify=True):
        raise NotImplementedError

    def header_trimmable(self, entry):
        return True

    def prefix_entry(self, entry, p):
        return replace_entry(entry, offset=p, tensors=prefix_tensors(entry, p))


toy_provider = default_provider.extended("kvshelf-cache-v1+toy-v1", [ToyCodec()])


def test_toy_codec_satisfies_the_protocol():
    assert isinstance(ToyCodec(), Codec)
    assert all(isinstance(codec, Codec) for codec in default_provider.codecs)


def test_extended_provider_knows_both_old_and_new_kinds():
    assert toy_provider.id == "kvshelf-cache-v1+toy-v1"
    assert set(toy_provider.kinds) == set(default_provider.kinds) | {"toy-bf16"}
    cache = ToyCache(mx.ones((1, 4, 3), dtype=mx.bfloat16))
    entry, arrays = toy_provider.snapshot(cache)
    assert entry.tensors[0].dtype == "bfloat16" and entry.tensors[0].nbytes == 24
    assert toy_provider.load(entry, arrays).values.dtype == mx.bfloat16
    with pytest.raises(IncompatibleFormat, match=r"0 matches for toy:bf16; expected exactly one"):
        default_provider.for_cache(cache)


def test_for_cache_needs_exactly_one_match():
    doubled = CodecProvider("twice", [ToyCodec(), type("Other", (ToyCodec,), {"kind": "toy-2"})()])
    with pytest.raises(IncompatibleFormat, match=r"2 matches for toy:bf16 \(toy-bf16, toy-2\)"):
        doubled.for_cache(ToyCache(mx.ones((1, 1, 3), dtype=mx.bfloat16)))
    with pytest.raises(IncompatibleFormat, match="0 matches for str"):
        default_provider.for_cache("not a cache")


def test_for_entry_unknown_kind():
    with pytest.raises(IncompatibleFormat, match="no codec for cache kind 'kv-plain'"):
        default_provider.for_entry("kv-plain")
    with pytest.raises(IncompatibleFormat, match="no codec for cache kind 'toy-bf16'"):
        default_provider.for_entry(CacheEntry(kind="toy-bf16", offset=0))


def test_check_provider():
    default_provider.check_provider("kvshelf-cache-v1")
    with pytest.raises(IncompatibleFormat, match="'mlx-cache-v3'; this reader is 'kvshelf-cache-v1'"):
        default_provider.check_provider("mlx-cache-v3")


def test_provider_ids_and_kinds_must_be_well_formed():
    with pytest.raises(IncompatibleFormat, match="non-blank"):
        CodecProvider("  ", [])
    with pytest.raises(IncompatibleFormat, match="two codecs claim kind 'toy-bf16'"):
        CodecProvider("dup", [ToyCodec(), ToyCodec()])


def test_for_cache_picks_by_dsa():
    assert default_provider.for_cache(filled(CASES_BY_ID["mla-f32-nodsa"])).kind == "mla"
    assert default_provider.for_cache(filled(CASES_BY_ID["mla-f32-dsa"])).kind == "mla-dsa"
