"""The usable-prefix rule (API.md): exact length trims one, untrimmable entries only at their length, floors,
longest wins, tokens confirmed one by one (never by hash alone), and isolation by identity and namespace."""

from __future__ import annotations


import mlx.core as mx
import pytest
from codec_cases import CASES_BY_ID, append
from store_cases import RingCache, open_test_store, ring_provider, same_caches, session, token_ids

from kvshelf import Identity
from kvshelf.errors import IdentityMismatch, InvalidCacheState, SnapshotNotFound
from kvshelf.latent_legos import LatentGeometry, MLACache
from kvshelf.store.identity import namespace_key
from kvshelf.store.index.keys import session_key
from kvshelf.store.prefix.hashing import boundary_hash, continuation, positions, tokens_array
from kvshelf.store.prefix.records import lineage_id

MLA = CASES_BY_ID["mla-f32-nodsa"]
LENGTHS = (40, 30, 30)  # 100 tokens: six 16-token boundaries


PROVIDER = ring_provider("test-ring-provider-v1")


def ring_session(n: int, seed: int = 0):
    caches = []
    for layer in range(2):
        c = RingCache(MLA.geometry())
        append(c, n, seed + layer)
        caches.append(c)
    return caches


def test_exact_length_match_trims_one_token(tmp_path):
    tokens = token_ids(100)
    with open_test_store(tmp_path / "s") as store:
        store.save("a", tokens, session(MLA, LENGTHS))
        assert store.lookup(tokens).length == 99
        assert store.lookup(tokens + [7]).length == 100
        assert store.lookup(tokens[:1]) is None  # p = min(lcp, 0) = 0
        assert store.lookup(tokens[:2]).length == 1
        assert store.lookup([]) is None
        r = store.restore_prefix(tokens)
        assert r.length == 99 and r.caches[0].offset == 99
        assert store.verify(deep=True) == []


def test_untrimmable_snapshot_is_only_reused_whole(tmp_path):
    tokens = token_ids(100)
    with open_test_store(tmp_path / "s", provider=PROVIDER) as store:
        store.save("ring", tokens, ring_session(100))
        assert store.lookup(tokens) is None  # would need a trim of one
        assert store.lookup(tokens[:60] + [1, 2]) is None
        assert store.restore_prefix(tokens[:60] + [1, 2]) is None
        hit = store.lookup(tokens + [5])
        assert (hit.session_id, hit.length) == ("ring", 100)
        with pytest.raises(InvalidCacheState, match="cannot be cut to 60"):
            store.restore_snapshot(hit.snapshot_id, 60)
        # A shorter trimmable snapshot is found below the deeper untrimmable one.
        store.save("short", tokens[:50], [MLACache(MLA.geometry()) for _ in range(2)] and _mla(50))
        hit = store.lookup(tokens[:70] + [3])
        assert (hit.session_id, hit.length) == ("short", 50)
        assert store.verify(deep=True) == []


def _mla(n, seed=0):
    caches = []
    for layer in range(2):
        c = MLACache(MLA.geometry())
        append(c, n, seed + layer)
        caches.append(c)
    return caches


def test_minimum_reusable_offset_is_honoured(tmp_path):
    case = CASES_BY_ID["encoded-affine4-nodsa-converted"]  # converts at its first append: floor 40
    tokens = token_ids(100)
    with open_test_store(tmp_path / "s") as store:
        info = store.save("enc", tokens, session(case, LENGTHS))
        assert info.minimum_reusable_offset == 40
        assert store.lookup(tokens[:39] + [1]) is None
        assert store.restore_prefix(tokens[:30] + [1]) is None
        assert store.lookup(tokens[:40] + [1]).length == 40
        r = store.restore_prefix(tokens[:55] + [1])
        assert r.length == 55 and r.caches[0].minimum_reusable_offset == 40
        with pytest.raises(InvalidCacheState, match="floor=40"):
            store.restore_snapshot(info.snapshot_id, 39)
        assert store.verify(deep=True) == []


def test_longest_usable_prefix_wins_and_ties_go_to_the_most_recently_used(tmp_path):
    base = token_ids(100)
    with open_test_store(tmp_path / "s") as store:
        store.save("short", base[:35] + token_ids(65, seed=5), session(MLA, LENGTHS, seed=1))
        store.save("long", base[:70] + token_ids(30, seed=6), session(MLA, LENGTHS, seed=2))
        store.save("other", token_ids(100, seed=9), session(MLA, LENGTHS, seed=3))
        assert (store.lookup(base).session_id, store.lookup(base).length) == ("long", 70)
        assert (store.lookup(base[:50]).session_id, store.lookup(base[:50]).length) == ("long", 49)
        store.save("twin", base[:70] + token_ids(30, seed=6), session(MLA, LENGTHS, seed=2))
        store.restore("long")  # now the most recently used of two equal candidates
        assert store.lookup(base).session_id == "long"
        store.restore("twin")
        assert store.lookup(base).session_id == "twin"
        assert store.verify(deep=True) == []


def test_candidates_are_confirmed_token_by_token(tmp_path):
    """A forged prefix record (as a hash collision would make) never yields reuse beyond the real match."""
    tokens = token_ids(100)
    with open_test_store(tmp_path / "s") as store:
        store.save("a", tokens, session(MLA, LENGTHS))
        nsk = namespace_key(store.id_key, "")
        tag = lineage_id(session_key(store.id_key, nsk, "a"))  # records name the session's lineage; heads resolve it to "a"
        unrelated = token_ids(100, seed=77)
        diverging = tokens[:20] + token_ids(80, seed=78)
        def forge(txn):  # collisions at every boundary of both prompts
            for prompt in (unrelated, diverging):
                arr = tokens_array(prompt)
                for pos in positions(len(arr)):
                    txn.dup_add("prefix", boundary_hash(nsk, arr, pos), continuation(arr, pos) + tag)

        store.index.write(forge)
        assert store.lookup(unrelated) is None
        hit = store.lookup(diverging)
        assert (hit.session_id, hit.length) == ("a", 20)
        same_caches(store.restore_prefix(diverging).caches, [c for c in session(MLA, LENGTHS)
                                                              if c.trim(80) or True])


def test_identity_and_namespace_isolation(tmp_path):
    tokens = token_ids(100)
    other = Identity("test-model", config_fingerprint="cfg-2", tokenizer_hash="tok-1")
    with open_test_store(tmp_path / "s") as store:
        info = store.save("a", tokens, session(MLA, LENGTHS))
        store.save("t", tokens, session(MLA, LENGTHS, seed=4), namespace="tenant-x")
        assert store.lookup(tokens, namespace="tenant-y") is None
        assert store.lookup(tokens, namespace="tenant-x").session_id == "t"
        with pytest.raises(SnapshotNotFound):
            store.restore("t")
    with open_test_store(tmp_path / "s", identity=other, max_bytes=10_000) as foreign:
        assert foreign.lookup(tokens) is None and foreign.sessions() == []
        with pytest.raises(IdentityMismatch, match="config_fingerprint"):
            foreign.restore("a")
        with pytest.raises(IdentityMismatch, match="stored 'cfg-1', expected 'cfg-2'"):
            foreign.restore_snapshot(info.snapshot_id)
        with pytest.raises(SnapshotNotFound):
            foreign.delete("a")
        foreign.save("mine", tokens[:8], session(MLA, (8,)))  # over its budget: evicts nothing of IDENTITY
        assert foreign.gc(dry_run=False).orphan_objects == []
        assert foreign.verify(deep=True) == []
    with open_test_store(tmp_path / "s") as store:
        assert {s.session_id for s in store.sessions()} == {"a", "t"}
        same_caches(store.restore("a").caches, session(MLA, LENGTHS))
        assert store.verify(deep=True) == []


def test_lookup_costs(tmp_path, monkeypatch):
    """A miss is one index probe; a hit on a long prompt costs O(log n) probes, however many snapshots share it.
    (Times are measured in benchmarks/, measure 7; here the work is counted.)"""
    from kvshelf.store.prefix.index_records import IndexRecords

    probes = []  # every boundary whose record count a lookup reads
    real_counts = IndexRecords.counts

    def counts(self, boundaries):
        probes.extend(boundaries)
        return real_counts(self, boundaries)

    g = LatentGeometry(kv_lora_rank=8, rope_head_dim=8)
    system = token_ids(2048, seed=1)
    with open_test_store(tmp_path / "s", chunk_tokens=512) as store:
        for k in range(60):
            c = MLACache(g)
            c.append_latent(mx.zeros((1, 2048 + 64, 8)), mx.zeros((1, 2048 + 64, 8)), None)
            store.save(f"s{k}", system + token_ids(64, seed=100 + k), [c])
        prompt_miss = token_ids(4096, seed=999)
        prompt_hit = system + token_ids(64, seed=130) + token_ids(1000, seed=3)
        monkeypatch.setattr(IndexRecords, "counts", counts)
        assert store.lookup(prompt_miss) is None
        assert probes == [boundary_hash(namespace_key(store.id_key, ""), tokens_array(prompt_miss), 1)]
        probes.clear()
        h = store.lookup(prompt_hit)
        assert (h.session_id, h.length) == ("s30", 2048 + 64)
        boundaries = 15 + (len(prompt_hit) // 16)  # positions 1..15 and every multiple of 16
        assert len(set(probes)) <= 4 * boundaries.bit_length(), (len(set(probes)), boundaries)


def test_the_best_of_many_snapshots_sharing_a_boundary_is_found(tmp_path):
    """More snapshots share the deepest boundary than a lookup token-compares: the sorted continuations find the
    one that matches furthest into the next block anyway."""
    g = LatentGeometry(kv_lora_rank=8, rope_head_dim=8)
    system = token_ids(150, seed=2)
    tails = {k: token_ids(60, seed=500 + k) for k in range(48)}
    with open_test_store(tmp_path / "s", chunk_tokens=64) as store:
        for k, tail in tails.items():
            c = MLACache(g)
            c.append_latent(mx.zeros((1, 210, 8)), mx.zeros((1, 210, 8)), None)
            store.save(f"s{k}", system + tail, [c])
        for k in (0, 17, 47):
            for cut in (151, 158, 159, 170):
                hit = store.lookup((system + tails[k])[:cut] + [60_000])
                assert (hit.session_id, hit.length) == (f"s{k}", cut), (k, cut)
        assert store.verify(deep=True) == []
