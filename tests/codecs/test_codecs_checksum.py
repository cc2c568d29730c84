"""Tensor checksums: xxh3-128 of the C-order bytes, whatever the array's layout or dtype."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import xxhash

from kvshelf.codecs import array_bytes, checksum


def test_checksum_is_xxh3_128_of_the_c_order_bytes():
    host = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert checksum(mx.array(host)) == xxhash.xxh3_128_hexdigest(host.tobytes())
    assert len(checksum(mx.array(host))) == 32


def test_non_contiguous_views_hash_as_their_c_order_copy():
    a = mx.arange(24, dtype=mx.float32).reshape(2, 3, 4)
    view = a.transpose(2, 0, 1)[:, 1:, ::2]
    copy = np.ascontiguousarray(np.array(view))
    assert bytes(array_bytes(view)) == copy.tobytes()
    assert checksum(view) == xxhash.xxh3_128_hexdigest(copy.tobytes())


def test_bfloat16_hashes_its_raw_bits():
    a = mx.array([1.0, -2.5, 3.0e-3, 0.0], dtype=mx.bfloat16)
    raw = np.array(a.view(mx.uint16)).tobytes()
    assert bytes(array_bytes(a)) == raw and len(raw) == 8
    assert checksum(a) == xxhash.xxh3_128_hexdigest(raw)
    assert checksum(a) != checksum(a.astype(mx.float16))


def test_contiguous_arrays_are_read_without_a_copy():
    a = mx.arange(1024, dtype=mx.float32)
    mx.eval(a)
    view = array_bytes(a)
    assert view.nbytes == 4096
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), np.array(a, copy=False))


def test_empty_and_scalar_arrays():
    assert checksum(mx.zeros((1, 0, 8))) == xxhash.xxh3_128_hexdigest(b"")
    assert checksum(mx.array(2.0)) == xxhash.xxh3_128_hexdigest(np.float32(2.0).tobytes())


def test_one_flipped_bit_changes_the_checksum():
    host = np.zeros(64, dtype=np.uint8)
    before = checksum(mx.array(host))
    host[37] ^= 0x10
    assert checksum(mx.array(host)) != before


def test_snapshot_without_checksums_leaves_slots_empty_and_loads_the_same():
    """The store hashes whole chunks, so it snapshots with ``checksums=False``: same entry, empty checksums."""
    import mlx.core as mx

    from kvshelf.codecs import default_provider
    from kvshelf.latent_legos import LatentGeometry, MLACache

    cache = MLACache(LatentGeometry(32, 16, 16))
    cache.append_latent(mx.random.normal((1, 5, 32)), mx.random.normal((1, 5, 16)), mx.random.normal((1, 5, 16)))
    full, arrays = default_provider.snapshot(cache)
    bare, bare_arrays = default_provider.snapshot(cache, checksums=False)
    assert all(slot.checksum for slot in full.tensors)
    assert [slot.checksum for slot in bare.tensors] == [""] * len(full.tensors)
    assert [(s.name, s.dtype, s.shape, s.token_axis, s.nbytes) for s in bare.tensors] == [
        (s.name, s.dtype, s.shape, s.token_axis, s.nbytes) for s in full.tensors
    ]
    loaded = default_provider.load(bare, bare_arrays)
    assert all(mx.array_equal(a, b).item() for a, b in zip(loaded.state, cache.state))
