"""Every latent lego and format goes through save -> restore -> restore_prefix -> restore_batch bit-exact."""

from __future__ import annotations

import os
import stat

import mlx.core as mx
import numpy as np
import pytest
from codec_cases import all_cases
from store_cases import open_test_store, same_caches, session, token_ids

from kvshelf.store.restore.destinations import Destinations

CASES = all_cases()


def trimmed(caches, n):
    for c in caches:
        c.trim(n)
    return caches


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_save_restore_prefix_batch_bit_exact(tmp_path, case):
    tokens = token_ids(12)
    with open_test_store(tmp_path / "s") as store:
        info = store.save("a", tokens, session(case))
        assert info.length == 12 and info.bytes_reused == 0 and info.bytes_written > 0
        restored = store.restore("a")
        assert restored.tokens == tokens and restored.length == 12
        same_caches(restored.caches, session(case))

        floor = info.minimum_reusable_offset
        p = max(floor, 7)
        hit = store.lookup(tokens[:p] + [60_001, 60_002])
        assert (hit.session_id, hit.length, hit.snapshot_length) == ("a", p, 12)
        prefix = store.restore_prefix(tokens[:p] + [60_001, 60_002])
        assert prefix.length == p and prefix.tokens == tokens[:p]
        same_caches(prefix.caches, trimmed(session(case), 12 - p))

        store.save("b", token_ids(9, seed=1), session(case, lengths=(6, 3), seed=7))
        batch = store.restore_batch(["a", hit, "b"])
        assert batch.lengths == [12, p, 9] and batch.tokens[1] == tokens[:p]
        for layer, cache in enumerate(batch.caches):
            rows = [store.restore("a").caches[layer], store.restore_prefix(tokens[:p] + [60_001]).caches[layer],
                    store.restore("b").caches[layer]]
            merged = rows[0].make_empty_batch()
            merged.merge_rows(rows)
            assert cache.row_offsets == [12, p, 9]
            same_caches([cache], [merged])
        assert store.verify(deep=True) == []


def test_blobs_are_standard_safetensors_and_private(tmp_path):
    case = next(c for c in CASES if c.lego == "mla" and not c.dsa)
    with open_test_store(tmp_path / "s") as store:
        info = store.save("a", token_ids(12), session(case))
        where = [store.admin.chunk_location(r.hash) for r in store.admin.manifest(info.snapshot_id).chunks]
        assert len(where) == 3 and len({name for name, _, _ in where}) == 1  # 12 tokens in chunks of 4, one pack
        name, offset, length = where[0]
        with open(store.bytes.path(name), "rb") as f:  # a chunk is a standard safetensors file inside the pack
            f.seek(offset)
            (tmp_path / "chunk.safetensors").write_bytes(f.read(length))
        loaded = mx.load(str(tmp_path / "chunk.safetensors"))
        assert {k.split(".")[0] for k in loaded} == {"0", "1"} and all(v.shape[1] == 4 for v in loaded.values())
        for root, dirs, files in os.walk(tmp_path / "s"):
            assert stat.S_IMODE(os.stat(root).st_mode) == 0o700, root
            for f in files:
                assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o600, f
        assert store.verify(deep=True) == []


def test_restore_destinations_own_their_buffers():
    """The zero-copy read path writes through numpy views: each MLX array must own a full, private buffer."""
    from kvshelf.codecs.header import CacheEntry, TensorSlot

    slots = [TensorSlot(name=n, dtype=d, shape=[1, 5, 3], token_axis=1, nbytes=0)
             for n, d in (("a", "float32"), ("b", "float32"), ("c", "bfloat16"), ("d", "uint8"))]
    dest = Destinations([CacheEntry(kind="x", offset=5, tensors=slots)])
    for k, host in enumerate(dest.hosts[0]):
        assert host.flags["C_CONTIGUOUS"] and host.flags["WRITEABLE"] and host.nbytes == dest.arrays[0][k].nbytes
        host.reshape(-1)[:] = np.arange(host.size, dtype=np.float64).astype(host.dtype) + k
    a, b, c, d = dest.finish()[0]
    assert c.dtype == mx.bfloat16
    assert np.array_equal(np.array(a).ravel(), np.arange(15, dtype=np.float32))
    assert np.array_equal(np.array(b).ravel(), np.arange(15, dtype=np.float32) + 1)  # no shared zeros buffer
    assert np.array_equal(np.array(c.view(mx.uint16)).ravel(), np.arange(15) + 2)
    assert np.array_equal(np.array(d).ravel(), np.arange(15) + 3)
    assert mx.array_equal(a + 1, b).item()  # MLX computes from the bytes written through the view


def test_zstd_blobs_read_transparently_under_the_same_hash(tmp_path):
    case = next(c for c in CASES if c.lego == "encoded" and c.fmt == "affine4" and not c.converted)
    tokens = token_ids(12)
    with open_test_store(tmp_path / "s") as store:
        store.save("a", tokens, session(case))
        m = store.admin.manifest(store.sessions()[0].snapshot_id)
        before = store.stats()["stored_bytes"]
        for ref in m.all_chunks:
            assert store.admin.rewrite_chunk(ref.hash, "zstd") is not None
            assert store.admin.chunk_info(ref.hash).encoding == "zstd"
        packs = dict(store.admin.iter_packs())
        raw_pack = store.admin.summaries()[m.snapshot_id].pack
        assert packs[raw_pack].live_chunks == 0 and packs[raw_pack].manifests == 1  # raw copies dead, manifest live
        store.admin.repack()  # moves the manifest out of the emptied pack: the raw copies go
        assert raw_pack not in dict(store.admin.iter_packs()) and not store.bytes.exists(raw_pack)
        assert store.admin.manifest(m.snapshot_id) == m
        assert store.stats()["stored_bytes"] != before
        same_caches(store.restore("a").caches, session(case))
        same_caches(store.restore_prefix(tokens[:9] + [1]).caches, trimmed(session(case), 3))
        assert store.verify(deep=True) == []
        assert store.admin.rewrite_chunk(m.chunks[0].hash, "raw") is not None
        same_caches(store.restore("a").caches, session(case))
        assert store.verify(deep=True) == []
