"""Audit of issue 4 guarantees the other store tests leave implicit: lookup reads no blobs (it works with the blob
directory gone), every identity field isolates on its own, and a miss costs well under a millisecond."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from codec_cases import CASES_BY_ID
from store_cases import IDENTITY, open_test_store, same_caches, session, token_ids

from kvshelf import Identity
from kvshelf.errors import IdentityMismatch, SnapshotNotFound
from kvshelf.latent_legos import LatentGeometry, MLACache

MLA = CASES_BY_ID["mla-f32-nodsa"]


def test_lookup_reads_no_blobs_it_answers_with_the_blob_directory_unreadable(tmp_path):
    root = tmp_path / "s"
    tokens = token_ids(40)
    with open_test_store(root) as store:
        store.save("a", tokens, session(MLA, (40,)))
        before = dict(store.counters)
        blobs = root / "packs"
        os.chmod(blobs, 0o000)  # any open of a pack (chunks, manifests) would now fail (EACCES)
        try:
            if os.access(blobs, os.R_OK):  # running as root: access bits do not bind; move it away
                os.chmod(blobs, 0o700)
                os.rename(blobs, root / "blobs-away")
            hit = store.lookup(tokens[:23] + [60_000])
            miss = store.lookup(token_ids(40, seed=9))
        finally:
            if (root / "blobs-away").exists():
                os.rename(root / "blobs-away", blobs)
            os.chmod(blobs, 0o700)
        assert (hit.session_id, hit.length, hit.snapshot_length) == ("a", 23, 40)
        assert miss is None
        assert store.counters["chunks_read"] == before["chunks_read"]
        assert store.verify(deep=True) == []


@pytest.mark.parametrize("field", ["model_id", "config_fingerprint", "tokenizer_hash"])
def test_each_identity_field_alone_isolates_a_snapshot(tmp_path, field):
    tokens = token_ids(20)
    values = {"model_id": IDENTITY.model_id, "config_fingerprint": IDENTITY.config_fingerprint,
              "tokenizer_hash": IDENTITY.tokenizer_hash}
    other = Identity(**dict(values, **{field: "changed"}))
    with open_test_store(tmp_path / "s") as store:
        info = store.save("a", tokens, session(MLA, (20,)))
    with open_test_store(tmp_path / "s", identity=other) as foreign:
        assert foreign.lookup(tokens) is None and foreign.restore_prefix(tokens) is None
        assert foreign.sessions() == []
        with pytest.raises(IdentityMismatch) as caught:
            foreign.restore_snapshot(info.snapshot_id)
        assert f"stored {values[field]!r}, expected 'changed'" in str(caught.value)
        with pytest.raises(IdentityMismatch):
            foreign.restore("a")
        with pytest.raises(SnapshotNotFound):
            foreign.delete("a")
        assert foreign.gc(dry_run=False).orphan_objects == []
    with open_test_store(tmp_path / "s") as store:
        same_caches(store.restore("a").caches, session(MLA, (20,)))
        assert store.verify(deep=True) == []


def test_a_miss_costs_one_index_probe(tmp_path, monkeypatch):
    """An 8192-token prompt that shares nothing with 40 stored snapshots: a miss is one prefix-index probe, converts
    no more than the first 256 tokens and reads no blob. (Speed itself is measured in benchmarks/, measure 7: about
    0.03 ms on this machine; unit tests count work instead of timing it.)"""
    from kvshelf.store.identity import namespace_key
    from kvshelf.store.prefix import search as lookup_module
    from kvshelf.store.prefix.hashing import boundary_hash, tokens_array
    from kvshelf.store.prefix.index_records import IndexRecords

    probes, converted = [], []  # every boundary whose record count a lookup reads; tokens converted
    real_counts, real_head = IndexRecords.counts, lookup_module.LazyTokens.head

    def counts(self, boundaries):
        probes.extend(boundaries)
        return real_counts(self, boundaries)

    def head(self, k):
        out = real_head(self, k)
        converted.append(len(self._arr))
        return out

    g = LatentGeometry(kv_lora_rank=8, rope_head_dim=8)
    system = token_ids(256, seed=1)
    with open_test_store(tmp_path / "s", chunk_tokens=256) as store:
        for k in range(40):
            c = MLACache(g)
            c.append_latent(mx.zeros((1, 512, 8)), mx.zeros((1, 512, 8)), None)
            store.save(f"s{k}", system + token_ids(256, seed=100 + k), [c])
        cold = token_ids(8192, seed=999)
        monkeypatch.setattr(IndexRecords, "counts", counts)
        monkeypatch.setattr(lookup_module.LazyTokens, "head", head)
        blobs_before = store.counters["chunks_read"]
        assert store.lookup(cold) is None
        assert probes == [boundary_hash(namespace_key(store.id_key, ""), tokens_array(cold[:1]), 1)]
        assert max(converted) <= 256
        assert store.counters["chunks_read"] == blobs_before
