"""mlx-lm prompt-cache files both ways: a ``save_prompt_cache`` file goes into a store (its caches plus the tokens
given or carried), a session comes out as a file ``load_prompt_cache`` loads (with metadata), bit-exact both ways,
also through ``kvshelf import`` / ``kvshelf export --format mlx-lm``. A file with a missing or foreign class,
truncated or corrupted is a clear ``KvShelfError`` and nothing is written to the store.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm_models import PROMPT, build, continue_greedy, greedy, quantized_cache
from tools_data import run_cli, run_json

from kvshelf import Identity, open_store
from kvshelf.errors import (
    CorruptData,
    IncompatibleFormat,
    InvalidCacheState,
    KvShelfError,
)
from kvshelf.latent_legos import LatentGeometry, MLACache
from kvshelf.latent_legos import kv as ours
from kvshelf.mlx_lm import (
    export_prompt_cache,
    import_prompt_cache,
    is_prompt_cache_file,
    read_prompt_cache,
)
from kvshelf.mlx_lm.files import as_mlx_lm, write_prompt_cache

MODELS = {"llama": make_prompt_cache, "glm_moe_dsa": make_prompt_cache, "gemma3_text": make_prompt_cache,
          "qwen3_next": make_prompt_cache, "mamba2": make_prompt_cache, "llama_qkv": quantized_cache}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """Per model: (tokens, live caches, a save_prompt_cache file of them)."""
    root = tmp_path_factory.mktemp("mlx-lm-files")
    out = {}
    for name, make in MODELS.items():
        model = build(name.removesuffix("_qkv"))
        cache = make(model)
        tokens, _ = greedy(model, PROMPT, cache, steps=3)
        file = root / f"{name}.safetensors"
        save_prompt_cache(str(file), cache, {"model": name, "chat_template": "plain"})
        out[name] = (PROMPT + tokens[:3], cache, file)
    return out


def leaves(caches):
    return tree_flatten([c.state for c in caches])


def assert_same_caches(a, b) -> None:
    assert [type(c) for c in a] == [type(c) for c in b]
    la, lb = leaves(a), leaves(b)
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (key, x), (_, y) in zip(la, lb):
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item(), key
        else:
            assert x == y, key


def nothing_stored(root: Path) -> bool:
    if not root.exists():
        return True
    with open_store(str(root), identity=Identity("m")) as store:
        sessions = store.sessions()
    blobs = [p for p in (root / "blobs").rglob("*") if p.is_file()] if (root / "blobs").exists() else []
    return not sessions and not blobs


@pytest.mark.parametrize("name", list(MODELS))
def test_a_save_prompt_cache_file_goes_in_and_comes_back_out_bit_exact(sessions, name, tmp_path):
    tokens, cache, file = sessions[name]
    assert is_prompt_cache_file(file)
    with open_store(str(tmp_path / "store"), identity=Identity(name)) as store:
        info = import_prompt_cache(store, file, tokens=tokens)
        assert info.length == len(tokens)
        restored = store.restore(name)
        assert restored.tokens == tokens
        assert_same_caches(restored.caches, cache)
        out = export_prompt_cache(store, name, tmp_path / "out.safetensors", metadata={"chat_template": "plain"})
    back, metadata = load_prompt_cache(str(out), return_metadata=True)
    assert_same_caches(back, cache)
    assert metadata["model"] == name and metadata["chat_template"] == "plain"
    assert json.loads(metadata["kvshelf_tokens"]) == tokens
    again = read_prompt_cache(out)  # carries its tokens and identity: no tokens needed
    assert again.tokens == tokens and again.identity["model_id"] == name
    assert again.metadata == {"model": name, "chat_template": "plain"}
    with open_store(str(tmp_path / "store2"), identity=Identity(name)) as store:
        import_prompt_cache(store, out, session_id="copy")
        assert_same_caches(store.restore("copy").caches, cache)


def rewrite(src: Path, dst: Path, *, metadata=None, arrays=None) -> Path:
    """The same file with its metadata and/or tensors edited (as a foreign or damaged writer would leave it)."""
    loaded, meta = mx.load(str(src), return_metadata=True)
    if metadata is not None:
        meta = metadata(dict(meta))
    if arrays is not None:
        loaded = arrays(dict(loaded))
    mx.save_safetensors(str(dst), loaded, meta)
    return dst


def bad_files(sessions, tmp_path):
    _, _, llama = sessions["llama"]
    _, _, glm = sessions["glm_moe_dsa"]
    data = llama.read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) - 100])
    header = bytearray(data)
    header[8] = ord("X")  # the JSON header no longer opens with {
    (tmp_path / "header.safetensors").write_bytes(bytes(header))
    yield "missing class", IncompatibleFormat, rewrite(
        llama, tmp_path / "missing.safetensors", metadata=lambda m: {k: v for k, v in m.items() if k != "1.1"})
    yield "foreign class", IncompatibleFormat, rewrite(
        llama, tmp_path / "foreign.safetensors", metadata=lambda m: {**m, "1.0": "MyOwnCache"})
    yield "module global", IncompatibleFormat, rewrite(
        llama, tmp_path / "global.safetensors", metadata=lambda m: {**m, "1.0": "PromptTrie"})
    child = next(k for k, _ in mx.load(str(glm)).items() if k.startswith("0.1.1"))
    yield "foreign child", IncompatibleFormat, rewrite(
        glm, tmp_path / "child.safetensors", arrays=lambda a: {**a, child: mx.array([ord(c) for c in "TokenBuffer"])})
    yield "truncated", CorruptData, tmp_path / "truncated.safetensors"
    yield "header bytes", CorruptData, tmp_path / "header.safetensors"
    yield "offset past the buffer", CorruptData, rewrite(
        llama, tmp_path / "offset.safetensors", arrays=lambda a: {**a, "0.2": mx.array(100000)})
    yield "heads disagree", CorruptData, rewrite(
        llama, tmp_path / "heads.safetensors", arrays=lambda a: {**a, "0.1": mx.concatenate([a["0.1"]] * 2, axis=1)})
    yield "no tokens", InvalidCacheState, llama


def test_bad_files_are_refused_clearly_and_nothing_is_written(sessions, tmp_path):
    tokens = sessions["llama"][0]
    cases = list(bad_files(sessions, tmp_path))
    assert len(cases) == 9
    for what, error, file in cases:
        root = tmp_path / f"store-{what.replace(' ', '-')}"
        with open_store(str(root), identity=Identity("m")) as store:
            with pytest.raises(error) as caught:
                import_prompt_cache(store, file, tokens=None if what == "no tokens" else tokens)
        assert isinstance(caught.value, KvShelfError), what
        assert nothing_stored(root), what


def test_our_exports_detect_a_flipped_tensor_byte(sessions, tmp_path):
    tokens, _, file = sessions["llama"]
    with open_store(str(tmp_path / "store"), identity=Identity("llama")) as store:
        import_prompt_cache(store, file, tokens=tokens)
        out = export_prompt_cache(store, "llama", tmp_path / "out.safetensors")
    data = bytearray(out.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's bytes
    (tmp_path / "flipped.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptData, match="checksum"):
        read_prompt_cache(tmp_path / "flipped.safetensors")


def test_the_cli_imports_mlx_lm_files_and_exports_them(sessions, tmp_path):
    tokens, cache, file = sessions["qwen3_next"]
    store = str(tmp_path / "store")
    ids = ",".join(map(str, tokens))
    refused = run_json("import", str(file), "--store", store, "--model-id", "qn", expect_rc=1)
    assert refused["failed"] == 1 and "carries no tokens" in refused["results"][0]["detail"]
    assert nothing_stored(Path(store))
    doc = run_json("import", str(file), "--store", store, "--model-id", "qn", "--tokens", ids, "--session", "chat")
    assert doc["results"][0]["status"] == "imported" and doc["results"][0]["format"] == "mlx-lm"
    again = run_json("import", str(file), "--store", store, "--model-id", "qn", "--tokens", ids, "--session", "chat")
    assert again["results"][0]["status"] == "already-present"
    out = tmp_path / "chat.safetensors"
    done = run_json("export", "chat", str(out), "--store", store, "--format", "mlx-lm")
    assert done["format"] == "mlx-lm" and done["tokens"] == len(tokens)
    back, metadata = load_prompt_cache(str(out), return_metadata=True)
    assert_same_caches(back, cache)
    assert metadata["model"] == "qn"
    assert run_json("verify", "--deep", "--store", store)["problems"] == []  # the offline tools know the kinds
    proc = run_cli("import", str(out), "--store", str(tmp_path / "other"), "--json")  # tokens and identity inside
    assert proc.returncode == 0, proc.stderr
    with open_store(str(tmp_path / "other"), identity=Identity("qn")) as st:
        assert st.restore("chat").tokens == tokens
    portable = tmp_path / "portable.safetensors"  # kvshelf's own file format takes mlx-lm's caches unchanged too
    run_json("export", "chat", str(portable), "--store", store)
    run_json("import", str(portable), "--store", str(tmp_path / "third"))
    with open_store(str(tmp_path / "third"), identity=Identity("qn")) as st:
        assert_same_caches(st.restore("portable").caches, cache)


@pytest.mark.parametrize("model_name, make", [
    ("llama", lambda: ours.KVCache()), ("llama", lambda: ours.QuantizedKVCache(group_size=32, bits=8)),
    ("qwen3", lambda: ours.RotatingKVCache(8, keep=4)),  # wrapped after 14 tokens
])
def test_kvshelfs_own_kv_legos_export_to_files_mlx_lm_continues(tmp_path, model_name, make):
    model = build(model_name)
    caches = [make() for _ in model.layers]
    tokens, _ = greedy(model, PROMPT, caches, steps=4)
    with open_store(str(tmp_path / "store"), identity=Identity("m")) as store:
        store.save("ours", PROMPT + tokens[:4], caches)
        out = export_prompt_cache(store, "ours", tmp_path / "out.safetensors")
    back = load_prompt_cache(str(out))
    assert all(type(c).__module__ == "mlx_lm.models.cache" for c in back)
    assert continue_greedy(model, tokens[4], back, 3)[0] == continue_greedy(model, tokens[4], caches, 3)[0]
    mine, theirs = continue_greedy(model, 5, caches, 2)[1], continue_greedy(model, 5, back, 2)[1]
    assert all(mx.array_equal(a, b).item() for a, b in zip(mine, theirs))


def test_caches_mlx_lm_cannot_load_are_refused_for_its_files(tmp_path):
    arrays = ours.ArraysCache(2)
    arrays[0] = mx.ones((1, 3))
    arrays.advance(4)
    converted = as_mlx_lm(arrays, 4)
    assert type(converted).__module__ == "mlx_lm.models.cache" and mx.array_equal(converted[0], arrays[0]).item()
    mla = MLACache(LatentGeometry(16, 8))
    mla.append_latent(mx.ones((1, 4, 16)), mx.ones((1, 4, 8)))
    with pytest.raises(InvalidCacheState, match="no mlx-lm class"):
        write_prompt_cache(tmp_path / "x.safetensors", [1, 2, 3, 4], [mla])
    assert not (tmp_path / "x.safetensors").exists()


def test_the_inbox_watcher_ingests_mlx_lm_files_that_carry_their_tokens(sessions, tmp_path):
    tokens, cache, file = sessions["mamba2"]
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    write_prompt_cache(inbox / "chat-9.safetensors", tokens, cache, identity={"model_id": "m2"})
    (inbox / "bare.safetensors").write_bytes(file.read_bytes())  # mlx-lm's own file: no tokens -> failed/
    proc = run_cli("watch", str(inbox), "--store", str(tmp_path / "store"), "--settle", "0.2s",
                   "--exit-when-idle", "2s")
    assert proc.returncode in (0, 1), proc.stderr
    assert (inbox / "done" / "chat-9.safetensors").exists() and (inbox / "failed" / "bare.safetensors").exists()
    assert "carries no tokens" in (inbox / "failed" / "bare.safetensors.reason.txt").read_text()
    with open_store(str(tmp_path / "store"), identity=Identity("m2")) as store:
        assert_same_caches(store.restore("chat-9").caches, cache)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_031_file_and_a_032_file_of_the_same_caches_import_bit_identically(sessions, name, tmp_path):
    """mlx-lm 0.31's layout (``meta_state``; written by ``mlx_lm_031_files`` from its documented layout) and 0.32's
    ``[metadata, classes, scalars]`` file of the same caches give the same caches, the same stored chunks and the
    same restore; before, a 0.31 file was refused with ``IncompatibleFormat``."""
    from mlx_lm_031_files import save_prompt_cache_031

    tokens, cache, new = sessions[name]
    old = tmp_path / f"{name}-031.safetensors"
    save_prompt_cache_031(old, cache, {"model": name, "chat_template": "plain"})
    assert "2.0" in mx.load(str(old), return_metadata=True)[1] and is_prompt_cache_file(old)
    read = read_prompt_cache(old, tokens=tokens)
    assert read.metadata == {"model": name, "chat_template": "plain"}
    assert_same_caches(read.caches, read_prompt_cache(new, tokens=tokens).caches)
    with open_store(str(tmp_path / "store"), identity=Identity(name)) as store:
        a = import_prompt_cache(store, new, session_id="v032", tokens=tokens)
        b = import_prompt_cache(store, old, session_id="v031", tokens=tokens)
        assert store.restore("v031").tokens == store.restore("v032").tokens == tokens
        assert_same_caches(store.restore("v031").caches, store.restore("v032").caches)
        assert_same_caches(store.restore("v031").caches, cache)
    with open_store(str(tmp_path / "store"), admin=True) as admin:
        ma, mb = admin.admin.manifest(a.snapshot_id), admin.admin.manifest(b.snapshot_id)
    assert [c.hash for c in ma.chunks] == [c.hash for c in mb.chunks] and ma.entries == mb.entries


def test_kvshelf_import_reads_a_031_file(sessions, tmp_path):
    from mlx_lm_031_files import save_prompt_cache_031

    tokens, cache, _ = sessions["llama"]
    old = tmp_path / "chat.safetensors"
    save_prompt_cache_031(old, cache)
    store = str(tmp_path / "store")
    doc = run_json("import", str(old), "--store", store, "--model-id", "m", "--tokens", ",".join(map(str, tokens)))
    assert doc["results"][0]["status"] == "imported" and doc["results"][0]["format"] == "mlx-lm"
    with open_store(store, identity=Identity("m")) as st:
        assert_same_caches(st.restore("chat").caches, cache)
