"""TurboQuantKVCache: five planes per §5 of the spec, reads = decode(encode(every input)), head-dim rules."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kv_cases import kv, raw, same

from kvshelf.errors import InvalidCacheState
from kvshelf.latent_legos.encodings.turboquant import decode_keys, decode_values, encode_keys, encode_values
from kvshelf.latent_legos.kv import KVCache, TurboQuantKVCache


@pytest.mark.parametrize("k_bits,v_bits", [(8, 3), (4, 2), (2, 8), (5, 5)])
def test_reads_are_the_decoded_encodings_of_every_appended_position(k_bits, v_bits):
    cache = TurboQuantKVCache(k_bits, v_bits)
    inputs = [kv(1, n, 30 + i, dk=128, dv=64) for i, n in enumerate([6, 1, 260])]
    for keys, values in inputs:
        got_k, got_v = cache.update_and_fetch(keys, values)
    keys = mx.concatenate([k for k, _ in inputs], axis=2)
    values = mx.concatenate([v for _, v in inputs], axis=2)
    assert same(got_k, decode_keys(*encode_keys(keys, k_bits)))
    assert same(got_v, decode_values(*encode_values(values, v_bits), v_bits))
    assert got_k.dtype == got_v.dtype == mx.bfloat16 and got_k.shape == (1, 2, 267, 128)


def test_plane_layout_follows_the_bit_widths():
    k8 = TurboQuantKVCache(8, 3)
    k8.update_and_fetch(*kv(1, 2, 0, dk=128, dv=128))
    assert [(a.dtype, a.shape[3]) for a in k8.state] == [
        (mx.int8, 128), (mx.float16, 4), (mx.float16, 4), (mx.uint8, 48), (mx.float16, 4)
    ]
    k4 = TurboQuantKVCache(4, 8)
    k4.update_and_fetch(*kv(1, 2, 0, dk=64, dv=256))
    assert [(a.dtype, a.shape[3]) for a in k4.state] == [
        (mx.uint8, 32), (mx.float16, 2), (mx.float16, 2), (mx.uint8, 256), (mx.float16, 8)
    ]
    assert k4.head_dims() == (64, 256) and all(a.shape[2] == 256 for a in k4.state)  # 256-step capacity


def test_unsupported_head_dims_and_bits_are_refused_without_change():
    cache = TurboQuantKVCache()
    cache.update_and_fetch(*kv(1, 3, 0))
    before = [raw(a) for a in cache.state]
    for dk, dv in ((96, 64), (64, 32)):
        with pytest.raises(InvalidCacheState, match="head dim"):
            cache.update_and_fetch(*kv(1, 1, 1, dk=dk, dv=dv))
    assert cache.offset == 3 and all(np.array_equal(a, raw(b)) for a, b in zip(before, cache.state))
    with pytest.raises(InvalidCacheState):
        TurboQuantKVCache(6, 3)


def test_from_kv_cache_encodes_the_live_window_and_keeps_the_floor():
    plain = KVCache()
    inputs = [kv(1, n, 40 + i) for i, n in enumerate([9, 4])]
    for keys, values in inputs:
        plain.update_and_fetch(keys, values)
    plain.trim(2)
    plain.minimum_reusable_offset = 5
    turbo = plain.to_turbo_quantized(8, 3)
    direct = TurboQuantKVCache(8, 3)
    direct.update_and_fetch(*[mx.concatenate(x, axis=2)[:, :, :11] for x in zip(*inputs)])
    assert (turbo.offset, turbo.minimum_reusable_offset, plain.offset) == (11, 5, 11)
    assert same(turbo.keys_and_values(), direct.keys_and_values())
    step = kv(1, 1, 99)
    assert same(turbo.update_and_fetch(*step), direct.update_and_fetch(*step))


def test_eight_bit_keys_are_close_and_trim_only_moves_the_offset():
    cache = TurboQuantKVCache(8, 3)
    keys, values = kv(1, 20, 5, dk=128, dv=128, dtype=mx.float32)
    got_k, got_v = cache.update_and_fetch(keys, values)
    k_err = float(mx.abs(got_k.astype(mx.float32) - keys).max())
    v_rms = float(mx.sqrt(mx.mean((got_v.astype(mx.float32) - values) ** 2)))
    assert k_err < 0.05 and v_rms < 0.25
    held = [raw(a) for a in cache.state]
    assert cache.trim(5) == 5 and cache.offset == 15
    assert all(np.array_equal(a, raw(b)) for a, b in zip(held, cache.state))
    assert cache.keys_and_values()[0].shape[2] == 15
