"""Maintenance never makes things worse: ``compact`` on stores of every kind (raw, zstd, the v1 fixture, a store
after many re-saves) never ends bigger than it began, restores stay bit-exact, and a second ``compact`` straight
after changes nothing (same files, same sizes)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tools_data import MODEL, make_caches
from v1_fixture import FIXTURE, IDENTITY, state_checksum

from kvshelf import open_store
from kvshelf.tools.admin import open_admin
from kvshelf.tools.compaction import compact

N = 64


def _bits(store) -> dict:
    return {s.session_id: [state_checksum(c) for c in store.restore(s.session_id).caches] for s in store.sessions()}


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
            and "locks" not in p.parts and "leases" not in p.parts and p.name not in ("data.mdb.walked", "lock.mdb")}


def _raw(root: Path) -> None:
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        for i in range(4):
            store.save(f"s{i}", list(range(i, i + N)), make_caches("mla", N, i))


def _zstd(root: Path) -> None:
    _raw(root)
    with open_admin(root) as store:
        compact(store, cold_after=0.0)  # every chunk cold: stored zstd


def _resaved(root: Path) -> None:
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        for n in range(16, 16 * 9, 16):  # a growing conversation: each save shares its old chunks, replacing the last
            store.save("grow", list(range(n)), make_caches("mla", n, 5))
            store.save(f"side{n % 3}", list(range(100, 100 + n)), make_caches("mla", n, n))


def _v1(root: Path) -> None:
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("lock.mdb"))


@pytest.mark.parametrize("build", [_raw, _zstd, _resaved, _v1], ids=["raw", "zstd", "resaved", "v1"])
@pytest.mark.parametrize("cold_after", [0.0, 3600.0], ids=["cold", "hot"])
def test_compact_never_ends_bigger_and_twice_is_a_no_op(tmp_path, build, cold_after) -> None:
    root = tmp_path / "s"
    build(root)
    identity = IDENTITY if build is _v1 else MODEL
    with open_store(root, identity=identity) as store:
        want = _bits(store)
    with open_admin(root) as store:
        first = compact(store, cold_after=cold_after, grace=0.0)
    assert first.bytes_after <= first.bytes_before, [(s.name, s.bytes_before, s.bytes_after) for s in first.steps]
    after_first = _files(root)
    assert sum(after_first.values()) <= first.bytes_before
    with open_admin(root) as store:
        second = compact(store, cold_after=cold_after, grace=0.0)
    assert _files(root) == after_first, [(s.name, s.count, s.items) for s in second.steps if s.count]
    assert second.bytes_after == second.bytes_before
    with open_store(root, identity=identity) as store:
        assert _bits(store) == want
        assert store.verify(deep=True) == []
