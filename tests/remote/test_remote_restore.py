"""Remote hits restored bit-exact through both fetch paths: whole and cut inside a chunk, kept locally, batched,
key/value caches (strided planes, bf16, quantized), and a snapshot this host cannot load (a miss, not an error)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from redis_servers import redis_server  # noqa: F401  (fixture)
from test_remote_faults import CHUNK, G, IDENTITY, READS, bits_of, caches_for, check_outcome, host, published, tokens

from kvshelf import open_store


@READS
def test_remote_hit_restores_bit_exact_and_is_kept_locally(tmp_path, redis_server, direct):
    toks = tokens(200)
    with host(tmp_path / "a", redis_server.url) as a, host(tmp_path / "b", redis_server.url, direct_reads=direct) as b:
        published(a, toks)
        prompt = toks + [1, 2, 3]
        restored = check_outcome(b, prompt, toks)
        assert restored is not None and restored.length == 200 and b.tier.counters["kept_local"] == 1
        again = b.restore_prefix(prompt)  # now served by the local copy, not fetched again
        assert again.length == 200 and b.tier.counters["chunks_fetched"] == 200 // CHUNK + 1
        assert bits_of(again.caches) == bits_of(caches_for(toks))


@READS
def test_prefix_cut_inside_a_chunk_restores_bit_exact(tmp_path, redis_server, direct):
    """A cut that is not a chunk boundary: the straddling piece goes through a temporary on both paths."""
    toks = tokens(200, seed=12)
    with host(tmp_path / "a", redis_server.url) as a, host(tmp_path / "b", redis_server.url, direct_reads=direct) as b:
        published(a, toks)
        prompt = toks[:77] + [99_999]
        r = check_outcome(b, prompt, toks)
        assert r.length == 77 and b.tier.counters["chunks_fetched"] == 3


def test_restore_batch_takes_remote_hits(tmp_path, redis_server):
    t1, t2 = tokens(120, seed=40), tokens(90, seed=41)
    with host(tmp_path / "a", redis_server.url) as a, host(tmp_path / "b", redis_server.url) as b:
        published(a, t1, session="one")
        published(a, t2, session="two")
        b.save("mine", t2[:50], caches_for(t2[:50]))
        hits = [b.lookup(t1 + [1]), b.lookup(t2 + [2]), "mine"]
        assert [h.length for h in hits[:2]] == [120, 90]
        batch = b.restore_batch(hits)
        assert batch.lengths == [120, 90, 50] and batch.tokens == [t1, t2, t2[:50]]
        for row, toks in enumerate([t1, t2, t2[:50]]):
            for layer, cache in enumerate(batch.caches):
                single = caches_for(toks)[layer]
                got = cache.extract_row(row)
                assert bits_of([got]) == bits_of([single])


def test_snapshot_of_a_provider_this_host_lacks_is_a_miss(tmp_path, redis_server):
    """Host A stores a kind host B's provider does not know: B misses it (and falls back to what it can load)."""
    from store_cases import RingCache, ring_provider

    toks = tokens(100, seed=60)
    ring = [RingCache(G) for _ in range(1)]
    ring[0].append_latent(mx.zeros((1, 100, 16)), mx.zeros((1, 100, 8)), None)
    with open_store(tmp_path / "a", IDENTITY, chunk_tokens=CHUNK, provider=ring_provider("other-provider-v1"),
                    remote=redis_server.url) as a, host(tmp_path / "b", redis_server.url) as b:
        a.save("ring", toks, ring)
        assert a.tier.flush(30) and a.tier.counters["published"] == 1
        b.save("mine", toks[:40], caches_for(toks[:40]))
        r = b.restore_prefix(toks + [1])
        assert r is not None and r.session_id == "mine" and r.length == 40  # the loadable local one
        assert b.tier.counters["restore_misses"] == 1 and b.tier.counters["chunks_fetched"] == 0
        assert b.restore_prefix(toks + [1]).session_id == "mine" and b.tier.counters["restore_misses"] == 1


@READS
@pytest.mark.parametrize("kind", ["kv", "qkv8", "turbo83"])
def test_key_value_caches_through_the_shared_tier(tmp_path, redis_server, direct, kind):
    """[B, H, T, D] planes (strided along the token axis: read through temporaries), bf16 and quantized."""
    from kv_cases import MAKERS, fill, raw

    def made(n):
        caches = [MAKERS[kind]() for _ in range(2)]
        for layer, c in enumerate(caches):
            fill(c, [n], seed=layer)
        return caches

    toks = tokens(100, seed=70)
    with host(tmp_path / "a", redis_server.url) as a, host(tmp_path / "b", redis_server.url, direct_reads=direct) as b:
        a.save("kv", toks, made(100))
        assert a.tier.flush(30) and a.tier.counters["published"] == 1
        r = b.restore_prefix(toks[:70] + [5])
        assert r is not None and r.length == 70 and r.caches[0].offset == 70
        whole = b.restore_prefix(toks + [5])
        assert whole.length == 100
        want = [raw(x) for c in made(100) for s in c.state for x in (s if isinstance(s, (list, tuple)) else [s])]
        got = [raw(x) for c in whole.caches for s in c.state for x in (s if isinstance(s, (list, tuple)) else [s])]
        assert len(want) == len(got) and all(np.array_equal(w, g) for w, g in zip(want, got))
