"""``kvshelf gc --incompatible``: the snapshots of every identity not in service (other weights, another
``--kv-bits``) are listed by ``--dry-run`` exactly, then removed with their chunks; the model in service keeps
every snapshot, at whatever path it is named."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from serve_harness import kvshelf_cli
from tiny_model_dir import make_model_dir

from kvshelf import open_store
from kvshelf.mlx_lm.serve.model_identity import model_identity

KV8 = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 5000}


def _caches(n: int, seed: int) -> list[KVCache]:
    out = []
    for layer in range(2):
        c = KVCache()
        k = mx.random.normal((1, 1, n, 32), key=mx.random.key(seed * 10 + layer)).astype(mx.float16)
        c.update_and_fetch(k, -k)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def _save(store_dir, identity, sessions: dict[str, int], seed: int, checkpoint: bool = False) -> set[str]:
    ids = set()
    with open_store(store_dir, identity=identity) as store:
        for i, (name, n) in enumerate(sessions.items()):
            tokens = list(range(10 + seed, 10 + seed + n))
            extra = {n // 2: _caches(n // 2, seed + i)} if checkpoint else None
            ids.add(store.save(name, tokens, _caches(n, seed + i), checkpoints=extra).snapshot_id)
            if checkpoint:
                ids |= {c.snapshot_id for c in store.list_checkpoints(name)}
    return ids


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_model_dir(root / "a", "llama", seed=0), make_model_dir(root / "b", "llama", seed=1)


def test_dry_run_lists_exactly_the_other_identities_then_gc_removes_them(models, tmp_path):
    model_a, model_b = models
    store = tmp_path / "store"
    kept = _save(store, model_identity(model_a), {"a1": 40, "a2": 24}, seed=0)
    other = _save(store, model_identity(model_b), {"b1": 40}, seed=1, checkpoint=True)  # other weights
    other |= _save(store, model_identity(model_a, cache_settings=KV8), {"q1": 32}, seed=2)  # --kv-bits 8
    moved = shutil.copytree(model_a, tmp_path / "moved-a")  # the model in service, named at another path

    dry = kvshelf_cli("gc", "--store", str(store), "--incompatible", "--dry-run", "--model", str(moved), "--json")
    assert dry.returncode == 0, dry.stderr
    doc = json.loads(dry.stdout)
    listed = {s["snapshot_id"] for ident in doc["incompatible"] for s in ident["snapshots"]}
    assert listed == other and not listed & kept and len(doc["incompatible"]) == 2
    assert doc["kept"] == [model_identity(model_a).key.hex()]
    human = kvshelf_cli("gc", "--store", str(store), "--incompatible", "--dry-run", "--model", str(moved))
    assert human.returncode == 0 and f"would remove {len(other)} snapshot(s) of 2 identit(ies)" in human.stdout
    assert all(sid in human.stdout for sid in other)

    # keeping the --kv-bits 8 identity by its key leaves only model B's
    key8 = model_identity(model_a, cache_settings=KV8).key.hex()
    both = kvshelf_cli("gc", "--store", str(store), "--incompatible", "--dry-run", "--model", str(moved),
                       "--keep-identity", key8, "--json")
    assert {i["model_id"] for i in json.loads(both.stdout)["incompatible"]} == {model_identity(model_b).model_id}

    done = kvshelf_cli("gc", "--store", str(store), "--incompatible", "--model", str(moved), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["remaining"] == 0 and result["sessions_deleted"] == 2 and result["bytes_freed"] > 0
    with open_store(store, admin=True) as admin:
        left = {m.snapshot_id for m in admin.admin.iter_manifests()}
    assert left == kept
    with open_store(store, identity=model_identity(moved)) as served:
        assert served.restore("a1").tokens[:3] == [10, 11, 12]


def test_gc_incompatible_without_any_identity_in_service_refuses(tmp_path):
    from kvshelf import Identity

    open_store(tmp_path / "s", identity=Identity("m")).close()
    refused = kvshelf_cli("gc", "--store", str(tmp_path / "s"), "--incompatible", "--dry-run")
    assert refused.returncode != 0 and "needs the identities in service" in refused.stderr
    assert "Traceback" not in refused.stderr
