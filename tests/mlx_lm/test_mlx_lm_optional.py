"""mlx-lm stays optional and plugins load by the rules: with the ``mlx_lm`` import blocked, kvshelf imports, saves
and restores its own caches (store, batch, snapshot file, CLI import/export) and refuses mlx-lm entries by name; a
plugin whose third-party dependency is absent is skipped quietly; a broken plugin is a clear error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = textwrap.dedent('''
    import sys
    class _NoMlxLm:
        """A finder that makes mlx-lm look uninstalled."""
        def find_spec(self, name, path=None, target=None):
            if name == "mlx_lm" or name.startswith("mlx_lm."):
                raise {error}
            return None
    sys.meta_path.insert(0, _NoMlxLm())
''')

WITHOUT_MLX_LM = textwrap.dedent('''
    import sys, tempfile
    import mlx.core as mx
    import msgspec
    from kvshelf import Identity, open_store
    from kvshelf.codecs import default_provider, load_snapshot, save_snapshot
    from kvshelf.errors import IncompatibleFormat
    from kvshelf.latent_legos import LatentGeometry, MLACache
    from kvshelf.latent_legos.kv import ArraysCache, KVCache
    from kvshelf.tools.transfer import export_session, import_file

    def layers(n):
        kv = KVCache()
        kv.update_and_fetch(mx.ones((1, 2, n, 8)), mx.zeros((1, 2, n, 8)))
        arrays = ArraysCache(2)
        arrays[0] = mx.ones((1, 3))
        arrays.advance(n)
        mla = MLACache(LatentGeometry(16, 8))
        mla.append_latent(mx.ones((1, n, 16)), mx.ones((1, n, 8)))
        return [kv, arrays, mla]

    root = tempfile.mkdtemp()
    with open_store(root + "/store", identity=Identity("m")) as store:
        store.save("a", list(range(5)), layers(5))
        store.save_async("b", list(range(3)), layers(3))
        store.flush()
        back = store.restore("a")
        assert [type(c).__name__ for c in back.caches] == ["KVCache", "ArraysCache", "MLACache"], back.caches
        assert back.caches[0].offset == 5
        batch = store.restore_batch(["a", "b"])
        assert batch.lengths == [5, 3]
        assert store.restore_prefix(list(range(5)) + [9]).length == 5
    save_snapshot(root + "/a.safetensors", list(range(5)), layers(5), identity={"model_id": "m"})
    assert load_snapshot(root + "/a.safetensors").tokens == list(range(5))
    export_session(root + "/store", "a", root + "/out.safetensors")
    assert import_file(root + "/store2", root + "/out.safetensors")["status"] == "imported"
    entry, arrays = default_provider.snapshot(layers(2)[0])
    foreign = msgspec.structs.replace(entry, kind="mlx-lm.kv")
    try:
        default_provider.for_entry(foreign)
    except IncompatibleFormat as exc:
        assert "install mlx-lm" in str(exc), exc
    else:
        raise AssertionError("an mlx-lm entry was accepted without mlx-lm")
    assert not any(m == "mlx_lm" or m.startswith("mlx_lm.") for m in sys.modules), "mlx_lm was imported"
    print("OK")
''')


def run(code: str, extra_path: str = "") -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path}, check=False,
                          capture_output=True, text=True, timeout=300)


def test_kvshelf_works_on_its_own_caches_with_mlx_lm_blocked():
    for error in ("ModuleNotFoundError(f'No module named {name!r}', name=name)", "ImportError('blocked')"):
        done = run(BLOCKER.format(error=error) + WITHOUT_MLX_LM)
        assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


def fake_plugin(tmp_path: Path, module_source: str) -> str:
    """A directory holding an installed-looking distribution whose ``kvshelf.codecs`` entry point is ``module``."""
    dist = tmp_path / "fakeplug-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kvshelf.codecs]\nfake = fakeplug_mod:codecs\n")
    (tmp_path / "fakeplug_mod.py").write_text(module_source)
    return str(tmp_path)


USE_MLX_LM_CACHES = textwrap.dedent('''
    import tempfile
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from kvshelf import Identity, open_store
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 4, 8)))
    with open_store(tempfile.mkdtemp() + "/s", identity=Identity("m")) as store:
        store.save("a", [1, 2, 3, 4], [cache])
        assert type(store.restore("a").caches[0]) is KVCache
    print("OK")
''')


def test_a_plugin_whose_dependency_is_absent_is_skipped_quietly(tmp_path):
    path = fake_plugin(tmp_path, "import some_dependency_nobody_installed\n\ndef codecs():\n    return []\n")
    done = run(USE_MLX_LM_CACHES, path)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-3000:]


def test_a_broken_plugin_is_a_clear_error(tmp_path):
    path = fake_plugin(tmp_path, "def codecs():\n    raise RuntimeError('half-installed')\n")
    done = run(USE_MLX_LM_CACHES, path)
    assert done.returncode != 0
    assert "IncompatibleFormat: codec plugin 'fake' (fakeplug_mod:codecs) failed to load: RuntimeError: " \
           "half-installed" in done.stderr, done.stderr[-3000:]
    path = fake_plugin(tmp_path / "other", "from kvshelf.codecs import no_such_name\n")
    done = run(USE_MLX_LM_CACHES, path)
    assert done.returncode != 0 and "failed to import" in done.stderr, done.stderr[-3000:]


def test_the_core_and_the_library_face_of_mlx_lm_never_import_prometheus_client():
    """Only ``kvshelf serve`` needs prometheus_client (its /metrics): the core and TieredPromptCache work without."""
    import subprocess
    import sys

    code = ("import sys, kvshelf, kvshelf.store, kvshelf.tools.cli, kvshelf.mlx_lm; "
            "from kvshelf.mlx_lm import TieredPromptCache; assert 'prometheus_client' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_package_declares_the_plugin_and_the_extra():
    """``pip install -e .`` registers the entry point; an uninstalled checkout reads the same declaration."""
    import tomllib

    from kvshelf.codecs.provider import plugin_points, source_tree_points

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["kvshelf.codecs"] == {"mlx-lm": "kvshelf.mlx_lm.plugin:codecs"}
    assert project["optional-dependencies"]["mlx-lm"] == ["mlx-lm>=0.32.1,<0.33", "prometheus_client>=0.20"]
    assert "mlx-lm>=0.32.1,<0.33" in project["optional-dependencies"]["test"]
    assert "prometheus_client>=0.20" in project["optional-dependencies"]["test"]
    assert [(p.name, p.value) for p in source_tree_points()] == [("mlx-lm", "kvshelf.mlx_lm.plugin:codecs")]
    assert "mlx-lm" in {p.name for p in plugin_points()}
