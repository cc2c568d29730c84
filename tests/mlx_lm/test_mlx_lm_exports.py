"""Exports are read back before they are reported done: ``kvshelf export`` with a bare name writes
``NAME.safetensors`` (mlx-lm's loader needs the suffix), every mlx-lm cache class comes out as a file mlx-lm's own
``load_prompt_cache`` loads (bit-exact), a ``CacheList`` of kvshelf's key/value legos is converted child by child,
one holding a latent lego (and glm_moe_dsa's latent caches) is refused with ``InvalidCacheState`` and a non-zero
exit (no file left), and ``import`` of a file that is not safetensors says so.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlx.utils import tree_flatten
from mlx_lm.models import cache as lm
from mlx_lm_models import PROMPT, build, greedy
from tools_data import run_cli, run_json

from kvshelf import Identity, open_store
from kvshelf.errors import IncompatibleFormat, InvalidCacheState
from kvshelf.latent_legos import LatentGeometry, MLACache
from kvshelf.latent_legos import kv as ours
from kvshelf.mlx_lm import make_prompt_cache
from kvshelf.mlx_lm.files import as_mlx_lm
from kvshelf.tools.transfer import export_session, import_file

TOKENS = list(range(100, 112))


def _kv(cache, dim: int = 8):
    keys = mx.random.normal((1, 2, len(TOKENS), dim), key=mx.random.key(len(type(cache).__name__)))
    cache.update_and_fetch(keys, keys * 2 + 1)
    return cache


def _arrays():
    cache = lm.ArraysCache(2)
    cache[0] = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    cache[1] = mx.ones((1, 4))
    return cache


EVERY_CLASS = {  # every cache class mlx-lm's load_prompt_cache rebuilds
    "KVCache": lambda: _kv(lm.KVCache()),
    "ConcatenateKVCache": lambda: _kv(lm.ConcatenateKVCache()),
    "QuantizedKVCache": lambda: _kv(lm.QuantizedKVCache(group_size=32, bits=8), dim=32),
    "RotatingKVCache": lambda: _kv(lm.RotatingKVCache(8, keep=2)),  # wrapped: 12 tokens in 8 slots
    "ChunkedKVCache": lambda: _kv(lm.ChunkedKVCache(8)),
    "ArraysCache": _arrays,
    "CacheList": lambda: lm.CacheList(_kv(lm.KVCache()), _arrays()),
}


def _same(a, b) -> None:
    assert [type(c) for c in a] == [type(c) for c in b]
    la, lb = tree_flatten([c.state for c in a]), tree_flatten([c.state for c in b])
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (key, x), (_, y) in zip(la, lb):
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item(), key
        else:
            assert x == y, key


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("name", list(EVERY_CLASS))
def test_every_mlx_lm_class_exports_under_a_bare_name_to_a_file_mlx_lm_loads(name, tmp_path) -> None:
    store = tmp_path / "store"
    caches = [EVERY_CLASS[name](), EVERY_CLASS[name]()]
    with open_store(store, identity=Identity("m")) as handle:
        handle.save("chat", TOKENS, caches)
    out = tmp_path / "out"
    out.mkdir()
    doc = run_json("export", "chat", str(out / "chat"), "--format", "mlx-lm", "--store", str(store))
    written = out / "chat.safetensors"
    assert doc["file"] == str(written) and _leftovers(out) == ["chat.safetensors"]
    back, metadata = lm.load_prompt_cache(str(written), return_metadata=True)
    _same(back, caches)
    assert metadata["model"] == "m"
    again = run_json("import", str(written), "--session", "again", "--store", str(tmp_path / "other"))
    assert again["results"][0]["status"] == "imported"
    with open_store(tmp_path / "other", identity=Identity("m")) as handle:
        _same(handle.restore("again").caches, caches)


def _mla():
    cache = MLACache(LatentGeometry(16, 8))
    cache.append_latent(mx.ones((1, len(TOKENS), 16)), mx.ones((1, len(TOKENS), 8)))
    return cache


def test_a_cache_list_of_kvshelf_legos_is_converted_child_by_child(tmp_path) -> None:
    caches = [lm.CacheList(_kv(ours.KVCache()), _kv(ours.RotatingKVCache(8, keep=2)))]
    with open_store(tmp_path / "store", identity=Identity("m")) as handle:
        handle.save("chat", TOKENS, caches)
    doc = run_json("export", "chat", str(tmp_path / "chat"), "--format", "mlx-lm", "--store", str(tmp_path / "store"))
    back = lm.load_prompt_cache(doc["file"])
    assert [type(c) for c in back] == [lm.CacheList]
    assert [type(c) for c in back[0].caches] == [lm.KVCache, lm.RotatingKVCache]
    mine, theirs = caches[0].caches[0], back[0].caches[0]  # the plain child bit-exact (ours keeps spare capacity;
    # the rotating one's ring order is mlx-lm's: test_mlx_lm_files continues a model over it)
    assert all(mx.array_equal(a[..., : len(TOKENS), :], b).item() for a, b in zip(mine.state, theirs.state))
    assert theirs.offset == back[0].caches[1].offset == len(TOKENS)


def test_latent_legos_are_refused_for_mlx_lm_files_and_leave_no_file(tmp_path) -> None:
    with pytest.raises(InvalidCacheState, match="CacheList's child 1: .*no mlx-lm class"):
        as_mlx_lm(lm.CacheList(_kv(ours.KVCache()), _mla()), len(TOKENS))
    model = build("glm_moe_dsa")  # kvshelf's make_prompt_cache: latent legos in its MLA layers
    caches = make_prompt_cache(model)
    tokens, _ = greedy(model, PROMPT, caches, steps=2)
    store = tmp_path / "store"
    with open_store(store, identity=Identity("glm")) as handle:
        handle.save("chat", PROMPT + tokens[:2], caches)
        handle.save("listed", TOKENS, [lm.CacheList(_kv(ours.KVCache()), _mla())])
    out = tmp_path / "out"
    out.mkdir()
    for session in ("chat", "listed"):
        proc = run_cli("export", session, str(out / session), "--format", "mlx-lm", "--store", str(store))
        text = " ".join(proc.stderr.split())
        assert proc.returncode == 1 and "InvalidCacheState" in text and "no mlx-lm class" in text, proc.stderr
        assert _leftovers(out) == []
    # kvshelf's own format carries them: a bare name gets the suffix, and the file reads back
    doc = run_json("export", "chat", str(out / "chat"), "--store", str(store))
    assert doc["file"] == str(out / "chat.safetensors") and _leftovers(out) == ["chat.safetensors"]
    run_json("import", str(out / "chat.safetensors"), "--session", "back", "--store", str(tmp_path / "other"))
    with open_store(tmp_path / "other", identity=Identity("glm")) as handle:
        assert handle.restore("back").tokens == PROMPT + tokens[:2]


def test_export_names_import_sniffing(tmp_path) -> None:
    store = tmp_path / "store"
    caches = [EVERY_CLASS["KVCache"]()]
    with open_store(store, identity=Identity("m")) as handle:
        handle.save("chat", TOKENS, caches)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli("export", "chat", str(out / "chat.bin"), "--format", "mlx-lm", "--store", str(store))
    assert proc.returncode == 1 and "chat.safetensors" in " ".join(proc.stderr.split()), proc.stderr
    assert _leftovers(out) == []
    kept = export_session(store, "chat", out / "chat.kvs")  # kvshelf's own files keep the name given
    assert kept["file"] == str(out / "chat.kvs")
    # an mlx-lm file that lost its suffix still imports (read by content), a text file is named for what it is
    mlx_file = Path(export_session(store, "chat", out / "lm", format="mlx-lm")["file"])
    bare = mlx_file.rename(out / "lm-renamed")
    assert import_file(tmp_path / "other", bare, session_id="bare")["status"] == "imported"
    (out / "notes.txt").write_text("not a snapshot at all\n")
    with pytest.raises(IncompatibleFormat, match="not a safetensors file"):
        import_file(tmp_path / "other", out / "notes.txt")
    (out / "empty").write_bytes(b"")
    with pytest.raises(IncompatibleFormat, match="not a safetensors file"):
        import_file(tmp_path / "other", out / "empty")
    proc = run_cli("import", str(out / "notes.txt"), "--store", str(tmp_path / "other"), "--json")
    assert proc.returncode == 1 and "IncompatibleFormat" in proc.stdout and "CorruptData" not in proc.stdout
