"""KvScheme and the latent cache a composition names for each layer."""

from __future__ import annotations

import pytest

from kvshelf.errors import InvalidCacheState
from kvshelf.latent_legos import (
    AffineFormat,
    EncodedLatentCache,
    KvScheme,
    LatentGeometry,
    MLACache,
    PagedLatentCache,
    TurboFormat,
    composed_latent_cache,
    latent_format_of,
)

G = LatentGeometry(kv_lora_rank=128, rope_head_dim=64, index_head_dim=64)


def test_latent_format_of_each_scheme():
    assert latent_format_of(KvScheme.bf16(), 0) is None
    assert latent_format_of(KvScheme.affine(4), 7) == AffineFormat(4, 64)
    assert latent_format_of(KvScheme.affine(8, 32, quantized_kv_start=5), 0) == AffineFormat(8, 32)
    layers = KvScheme.affine_layers({3: (4, 64), 1: (8, 128)}, quantized_kv_start=2)
    assert latent_format_of(layers, 1) == AffineFormat(8, 128)
    assert latent_format_of(layers, 3) == AffineFormat(4, 64)
    assert latent_format_of(layers, 2) is None
    assert latent_format_of(KvScheme.turbo(), 9) == TurboFormat(8, 3)
    assert latent_format_of(KvScheme.turbo(4, 2), 0) == TurboFormat(4, 2)
    assert layers.cache_key == "affine-layers:1=8:128,3=4:64@2" and KvScheme.turbo().cache_key == "turbo:8:3"


def test_composed_latent_cache_names_the_lego():
    assert type(composed_latent_cache(KvScheme.bf16(), None, 0, G)) is MLACache
    encoded = composed_latent_cache(KvScheme.affine(4, 64, quantized_kv_start=512), None, 0, G)
    assert isinstance(encoded, EncodedLatentCache) and encoded.start == 512
    assert encoded.signature() == "kv:latent:dsa:affine:4:64:512"
    turbo = composed_latent_cache(KvScheme.turbo(8, 3), None, 2, G)
    assert turbo.signature() == "kv:latent:dsa:turbo:8:3:0"
    layers = KvScheme.affine_layers({1: (4, 64)})
    assert type(composed_latent_cache(layers, None, 0, G)) is MLACache
    assert composed_latent_cache(layers, None, 1, G).signature() == "kv:latent:dsa:affine:4:64:0"
    paged = composed_latent_cache(KvScheme.turbo(4, 3), 128, 0, G)
    assert isinstance(paged, PagedLatentCache) and paged.signature() == "kv:latent-paged:dsa:turbo:4:3:128"
    assert composed_latent_cache(KvScheme.bf16(), 16, 0, G).signature() == "kv:latent-paged:dsa:f32:16"


def test_bad_schemes_are_rejected():
    with pytest.raises(InvalidCacheState):
        KvScheme.affine(7)
    with pytest.raises(InvalidCacheState):
        KvScheme.affine(4, 48)
    with pytest.raises(InvalidCacheState):
        KvScheme.turbo(6, 3)
    with pytest.raises(InvalidCacheState):
        KvScheme.affine(4, quantized_kv_start=-1)
    with pytest.raises(InvalidCacheState):
        KvScheme.affine_layers({})
    with pytest.raises(InvalidCacheState):
        latent_format_of("bf16", 0)
    with pytest.raises(InvalidCacheState):
        KvScheme("fp8")
    with pytest.raises(InvalidCacheState):
        composed_latent_cache(KvScheme.bf16(), 0, 0, G)
