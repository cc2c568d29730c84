"""A 32K-token session of a tiny mlx-lm model, stored in two incremental saves (16K, then +16K on the same
``KVCache`` objects), restores through a reopened store and continues bit-identically: the same greedy tokens and
the same float32 logits at every step as the session that was never stored (issue 32).

The 32K positions are seeded keys and values written through ``KVCache.update_and_fetch`` (mlx-lm's own path), not a
32K prefill: what is under test is that every stored row comes back and that the verified-prefix save put the right
rows in the right chunks; a prefill of 32K tokens on a CPU would only make the test slow. The model's KV is 512
bytes per token (2 layers × 1 head × 32 dims × keys and values, float32), 16 MiB at 32K.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm_models import build, continue_greedy, same_run
from store_cases import open_test_store

TOKENS = 32 * 1024
HALF = TOKENS // 2


def fill(cache: KVCache, n: int, seed: int) -> None:
    k1, k2 = mx.random.split(mx.random.key(seed))
    cache.update_and_fetch(mx.random.normal((1, 1, n, 32), key=k1), mx.random.normal((1, 1, n, 32), key=k2))


def test_restored_32k_session_continues_bit_identically(tmp_path):
    model = build("llama")
    caches = [KVCache() for _ in model.layers]
    ids = [(7 * i) % 90 + 3 for i in range(TOKENS)]
    for i, c in enumerate(caches):
        fill(c, HALF, 10 + i)
    mx.eval([c.state for c in caches])
    with open_test_store(tmp_path / "s", chunk_tokens=1024) as store:
        store.save("long", ids[:HALF], caches)
        for i, c in enumerate(caches):
            fill(c, TOKENS - HALF, 20 + i)
        mx.eval([c.state for c in caches])
        before = store.counters["bytes_written"]
        info = store.save("long", ids, caches)  # the same objects, grown: only the new half is written
        assert info.length == TOKENS
        assert store.counters["bytes_written"] - before == TOKENS // 2 * 2 * 2 * 32 * 4
        assert store.counters["chunks_verified"] == HALF // 1024
    with open_test_store(tmp_path / "s", chunk_tokens=1024) as store:
        restored = store.restore("long").caches
    assert [c.offset for c in restored] == [TOKENS] * len(caches)
    want = continue_greedy(model, ids[-1], caches, steps=8)
    got = continue_greedy(model, ids[-1], restored, steps=8)
    assert same_run(got, want)


def test_prefix_of_a_long_session_is_restored_into_a_buffer_of_its_own_length(tmp_path):
    """``restore_prefix`` of 1,000 of 8,192 stored positions gives mlx-lm a buffer of mlx-lm's own step (1,024 rows),
    not the saved 8,192-row buffer zero-filled past the prefix (which cost a full-size allocation and a copy of
    the rows read), and continues exactly like the session trimmed to that prefix."""
    model = build("llama")
    n, p = 8192, 1000
    caches = [KVCache() for _ in model.layers]
    ids = [(11 * i) % 90 + 3 for i in range(n)]
    for i, c in enumerate(caches):
        fill(c, n, 30 + i)
    mx.eval([c.state for c in caches])
    with open_test_store(tmp_path / "s", chunk_tokens=256) as store:
        store.save("long", ids, caches)
        got = store.restore_prefix(ids[:p] + [95])
    assert got is not None and got.length == p
    assert [c.keys.shape[2] for c in got.caches] == [1024] * len(caches)
    assert [c.offset for c in got.caches] == [p] * len(caches)
    for c in caches:
        c.trim(n - p)
    want = continue_greedy(model, ids[p], caches, steps=6)
    assert same_run(continue_greedy(model, ids[p], got.caches, steps=6), want)
