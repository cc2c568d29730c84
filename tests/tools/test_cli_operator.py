"""The CLI as an operator pipes it: tables fit ``COLUMNS`` (80 when piped) without cutting a session id, ``ls --ids``
prints ids that paste into ``pin``, ``repair --dry-run`` says what it would do, and a ``--remote`` URL that cannot be
parsed is one line on stderr (its password never shown), not a traceback."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from tools_data import run_cli, run_json

from kvshelf import Identity, open_store

IDENTITY = Identity("weights:0123456789abcdef0123456789abcdef", "c" * 64, "t" * 64)


def _caches(n: int) -> list[KVCache]:
    out = []
    for layer in range(2):
        c = KVCache()
        k = mx.random.normal((1, 1, n, 32), key=mx.random.key(layer)).astype(mx.float16)
        c.update_and_fetch(k, -k)
        out.append(c)
    return out


@pytest.fixture
def store(tmp_path):
    """Sessions named as ``kvshelf serve`` names them (``prompt-<n>-<xxh3>``, 44 characters), one in a tenant."""
    root = tmp_path / "store"
    ids = []
    with open_store(root, identity=IDENTITY) as st:
        for i, n in enumerate((1234, 20, 300)):
            sid = f"prompt-{n}-{i:032x}"
            st.save(sid, list(range(n)), _caches(n))
            ids.append(sid)
        st.save("tenant-session-with-a-rather-long-name-0001", list(range(12)), _caches(12), namespace="acme")
    return root, ids + ["tenant-session-with-a-rather-long-name-0001"]


@pytest.mark.parametrize("columns", ["80", "60"])
def test_ls_piped_fits_columns_and_never_cuts_a_session_id(store, columns):
    root, ids = store
    proc = run_cli("ls", "--store", str(root), env={"COLUMNS": columns})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= int(columns), "\n".join(lines)
    assert "…" not in proc.stdout
    for sid in ids:
        assert any(sid in line for line in lines), sid  # whole, on one line


def test_ls_ids_paste_into_pin(store):
    root, ids = store
    proc = run_cli("ls", "--ids", "--store", str(root), env={"COLUMNS": "80"})
    assert proc.returncode == 0 and sorted(proc.stdout.split("\n")[:-1]) == sorted(ids)
    for sid in proc.stdout.split():
        ns = ["--namespace", "acme"] if sid.startswith("tenant") else []
        pinned = run_cli("pin", sid, *ns, "--store", str(root))
        assert pinned.returncode == 0, pinned.stderr
    assert all(r["pinned"] for r in run_json("ls", "--store", str(root))["sessions"])


def test_repair_dry_run_says_what_it_would_do(store):
    root, _ = store
    orphan = root / "packs" / ("f" * 32 + ".pack")
    orphan.write_bytes(next((root / "packs").glob("*.pack")).read_bytes())
    proc = run_cli("repair", "--dry-run", "--store", str(root), env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "repair --dry-run (nothing changed): would heal 0 chunk(s), drop 0 lost session(s)" in text
    assert "would reclaim 1 object(s)" in text and "would healed" not in text and orphan.exists()
    done = run_cli("repair", "--store", str(root), env={"COLUMNS": "80"})
    assert "repair: healed 0 chunk(s)" in " ".join(done.stdout.split()) and not orphan.exists()


@pytest.mark.parametrize("url", ["redis://user:s3cret@[::1", "redis://user:s3cret@host:notaport/0",
                                 "http://user:s3cret@host:6379"])
def test_a_remote_url_that_cannot_be_used_is_one_line(store, url):
    root, _ = store
    proc = run_cli("ls", "--store", str(root), "--remote", url, env={"COLUMNS": "80"})
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "RemoteConfigError" in proc.stderr and "Traceback" not in proc.stderr and "s3cret" not in proc.stderr
    doc = json.loads(run_cli("gc", "--store", str(root), "--remote", url, "--json").stdout)
    assert doc["error"] == "RemoteConfigError" and "s3cret" not in doc["message"]
