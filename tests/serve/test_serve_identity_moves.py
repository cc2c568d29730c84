"""The served model's identity is what its weights are, not where they sit: a copy at another path hits, other
weights of the same shapes miss with ``other_identity``, a quantized KV cache is another identity, and a restart
reads no weight bytes again (the fingerprint sidecar in the store directory)."""

from __future__ import annotations

import os
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from serve_harness import Server, conversation
from tiny_model_dir import make_model_dir, words

from kvshelf import open_store
from kvshelf.mlx_lm.codecs.kv import PlainCodec
from kvshelf.mlx_lm.serve.model_identity import model_identity
from kvshelf.mlx_lm.serve.weights_fingerprint import SIDECAR_NAME, FingerprintSidecar

TOKENS = list(range(8, 8 + 40))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    a = make_model_dir(root / "here", "llama", seed=0)
    moved = root / "elsewhere" / "same-model"
    shutil.copytree(a, moved)
    other = make_model_dir(root / "other", "llama", seed=1)  # same config, tokenizer and shapes; other weights
    return a, moved, other


def _caches(n: int = len(TOKENS)) -> list[KVCache]:
    out = []
    for layer in range(2):
        c = KVCache()
        k = mx.random.normal((1, 1, n, 32), key=mx.random.key(layer)).astype(mx.float16)
        c.update_and_fetch(k, -k)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def _save_then_look_up(store_dir, saved_under, looked_up_under):
    with open_store(store_dir, identity=saved_under) as store:
        store.save("s", TOKENS, _caches())
    with open_store(store_dir, identity=looked_up_under) as store:
        hit = store.lookup(TOKENS + [99])
        return hit, (store.explain_miss(TOKENS + [99]) if hit is None else None)


def test_the_same_weights_at_two_paths_are_one_identity_and_hit(models, tmp_path):
    here, moved, _ = models
    a = model_identity(here, fingerprints=tmp_path / "store")
    b = model_identity(moved, fingerprints=tmp_path / "store")
    assert a == b and a.model_id.startswith("weights:") and str(here) not in a.model_id
    hit, _ = _save_then_look_up(tmp_path / "store", a, b)
    assert hit is not None and hit.length == len(TOKENS)


def test_other_weights_of_the_same_shapes_miss_as_another_identity(models, tmp_path):
    here, _, other = models
    a, o = model_identity(here), model_identity(other)
    assert a.config_fingerprint == o.config_fingerprint and a.tokenizer_hash == o.tokenizer_hash  # only the bytes
    assert a.model_id != o.model_id
    hit, reason = _save_then_look_up(tmp_path / "store", a, o)
    assert hit is None and reason == "other_identity"


def test_kv_bits_8_against_none_misses(models, tmp_path):
    here, _, _ = models
    plain = model_identity(here)
    quant = model_identity(here, cache_settings={"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0})
    hit, reason = _save_then_look_up(tmp_path / "store", quant, plain)
    assert hit is None and reason == "other_identity"


def test_a_codec_layout_change_is_another_identity_a_patch_release_is_not(models, monkeypatch):
    here, _, _ = models
    before = model_identity(here)
    monkeypatch.setattr(PlainCodec, "format_tag", 2)  # what a release changing mlx-lm.kv's layout ships
    assert model_identity(here).config_fingerprint != before.config_fingerprint
    monkeypatch.undo()
    import mlx_lm

    monkeypatch.setattr(mlx_lm, "__version__", mlx_lm.__version__ + ".post1")  # a patch release: same layouts
    assert model_identity(here) == before


def test_model_id_asserted_hashes_nothing_and_names_both_paths(models, tmp_path):
    here, moved, _ = models
    sidecar = FingerprintSidecar.in_store(tmp_path / "store")
    a = model_identity(here, model_id="team/tiny-v1", fingerprints=sidecar)
    b = model_identity(moved, model_id="team/tiny-v1", fingerprints=sidecar)
    assert a == b and a.model_id == "team/tiny-v1" and sidecar.hashed == 0
    assert not (tmp_path / "store" / SIDECAR_NAME).exists()


def test_the_sidecar_remembers_digests_and_any_change_to_a_file_invalidates_its_entry(tmp_path):
    model = make_model_dir(tmp_path / "m", "llama", seed=3)
    cold = FingerprintSidecar.in_store(tmp_path / "store")
    first = model_identity(model, fingerprints=cold)
    assert cold.hashed == 1 and (tmp_path / "store" / SIDECAR_NAME).is_file()
    warm = FingerprintSidecar.in_store(tmp_path / "store")
    assert model_identity(model, fingerprints=warm) == first and warm.hashed == 0  # a restart reads no weights

    weights = model / "model.safetensors"
    st = os.stat(weights)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # an in-place edit of the same size, the mtime put back: the ctime still moved
    with open(weights, "r+b") as f:
        f.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(weights).st_size == st.st_size and os.stat(weights).st_mtime_ns == st.st_mtime_ns
    edited = FingerprintSidecar.in_store(tmp_path / "store")
    changed = model_identity(model, fingerprints=edited)
    assert edited.hashed == 1 and changed.model_id != first.model_id

    (tmp_path / "store" / SIDECAR_NAME).write_text("{not json")  # a damaged sidecar costs a re-hash, no error
    damaged = FingerprintSidecar.in_store(tmp_path / "store")
    assert model_identity(model, fingerprints=damaged) == changed and damaged.hashed == 1


def test_kvshelf_serve_from_a_copied_directory_continues_from_disk(models, tmp_path):
    here, moved, _ = models
    store = tmp_path / "store"
    msgs = conversation(words(120), ["hello world what is the cache"], [])
    with Server(here, store, tmp_path / "here.log") as first:
        r1 = first.chat(msgs)
        first.wait_log(rf"kvshelf write-behind saved tokens={r1['prompt_tokens'] + r1['completion_tokens']}\b")
    with Server(moved, store, tmp_path / "moved.log") as second:
        msgs2 = conversation(words(120), ["hello world what is the cache", "and the disk"], [r1["text"]])
        r2 = second.chat(msgs2)
        line = second.prefix_lines()[-1]
        assert line["source"] == "disk" and line["cached"] == r2["cached_tokens"] > r1["prompt_tokens"]
    with Server(moved, store, tmp_path / "asserted.log", extra=("--model-id", "team/tiny-v1")) as named:
        assert "open for model team/tiny-v1 " in named.log()
        named.chat(msgs2)
        assert named.prefix_lines()[-1]["source"] == "none"
        assert "reason=other_identity" in named.log()  # an asserted name is its own identity


def test_two_hosts_with_the_model_at_different_paths_share_through_the_remote_tier(models, tmp_path):
    """Host A serves the model from one path, host B (its own local store) from another: B's first request is a
    ``source=remote`` hit on A's prefix; with a path-based identity it was ``other_identity``."""
    from redis_servers import RedisServer

    here, moved, _ = models
    remote = RedisServer()
    try:
        extra = ("--remote", remote.url, "--remote-prefix", "moves:", "--remote-option", "keep_local=false")
        msgs = conversation(words(200), ["hello world"], [])
        with Server(here, tmp_path / "store-a", tmp_path / "a.log", extra=extra) as a:
            first = a.chat(msgs)
            a.signal(2)  # closing the store publishes what is queued for the shared tier
            assert a.wait() == 0
        with Server(moved, tmp_path / "store-b", tmp_path / "b.log", extra=extra) as b:
            again = b.chat(msgs)
            assert again["text"] == first["text"]
            line = b.prefix_lines()[-1]
            assert line["source"] == "remote" and line["cached"] == again["cached_tokens"] > 0
    finally:
        remote.close()
