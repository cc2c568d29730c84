"""A padded restore destination reads zeros where no chunk wrote, even when MLX hands it recycled memory.

``restoring.read_direct`` allocates uninitialised destinations and zeroes what no piece covers after the reads
(``_zero_uncovered``). A kvshelf ``KVCache`` is restored into a ``[1, H, capacity, D]`` plan whose columns past
the offset are such padding; attention masks them, but ``0 * NaN`` is NaN, so garbage there would poison a decode.
The test makes the garbage likely: it fills and frees buffers of the destinations' size with NaN first (MLX keeps
freed buffers in its cache and hands them out again), then checks every padding column is exactly zero."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from store_cases import open_test_store, token_ids

from kvshelf.latent_legos.kv import KVCache

H, D, T = 4, 64, 300  # capacity is a multiple of 256 past T: padding in every head row


def _caches(layers: int = 3) -> list[KVCache]:
    out = []
    for layer in range(layers):
        c = KVCache()
        k = mx.random.normal((1, H, T, D), key=mx.random.key(layer)).astype(mx.float16)
        c.update_and_fetch(k, -k)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def test_padding_columns_are_zero_on_recycled_memory(tmp_path):
    caches = _caches()
    with open_test_store(tmp_path / "s", chunk_tokens=64) as store:
        store.save("a", token_ids(T), caches)
        for _ in range(3):
            first = store.restore("a").caches
            shape = first[0].keys.shape
            assert shape[2] > T  # the restore is padded
            del first
            poison = [mx.full(shape, float("nan"), dtype=mx.float16) for _ in range(12)]
            mx.eval(poison)
            del poison  # back to MLX's buffer cache: the next restore's destinations may be these
            restored = store.restore("a").caches
            for got, want in zip(restored, caches):
                for arr, ref in ((got.keys, want.keys), (got.values, want.values)):
                    host = np.array(arr.astype(mx.float32))
                    assert np.array_equal(host[:, :, :T], np.array(ref[:, :, :T].astype(mx.float32)))
                    assert np.all(host[:, :, T:] == 0), "padding is not zero"
