"""Compaction: lossless for every kind of snapshot, reports what it saved, skips leased snapshots, and runs beside a
serving process without that process ever seeing an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tools_data import MODEL, OTHER, private_copy, reads, template_store, tokens_for

from kvshelf import open_store  # noqa: E402
from kvshelf.tools.admin import open_admin  # noqa: E402
from kvshelf.tools.compaction import compact, merge_plan  # noqa: E402
from kvshelf.tools.densify import is_dense  # noqa: E402


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return template_store(tmp_path_factory, "compaction")


@pytest.fixture
def store_dir(template, tmp_path) -> Path:
    return private_copy(template, tmp_path)


def _bits(arrays) -> list[bytes]:
    return [a.tobytes() for a in arrays]


def observe(root: Path) -> dict[str, object]:
    """Every way a serving process reads the store, as bytes: whole restores, prefixes, a batch, lookups."""
    seen: dict[str, object] = {}
    with open_store(root, identity=MODEL, chunk_tokens=32) as store:
        sessions = sorted((s.namespace, s.session_id) for s in store.sessions())
        for ns, sid in sessions:
            r = store.restore(sid, namespace=ns)
            seen[f"{ns}/{sid}"] = (r.tokens, _bits(reads(r.caches)))
            for p in (41, 64, 65):  # past the 40-token prompt every session shares: one session matches
                prompt = list(r.tokens[:p]) + [123456]
                hit = store.restore_prefix(prompt, namespace=ns)
                seen[f"{ns}/{sid}@{p}"] = None if hit is None else (hit.length, _bits(reads(hit.caches)))
        batch = store.restore_batch(["s-mla", "s-mla-copy", "s-mla"])
        seen["batch"] = (batch.lengths, batch.tokens, _bits(reads(batch.caches)))
    with open_store(root, identity=OTHER) as store:
        seen["other"] = _bits(reads(store.restore("s-other").caches))
    return seen


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
            and "locks" not in p.parts and p.name != "data.mdb.walked"}  # an open may record its page walk


def test_compaction_is_lossless_for_every_kind_and_reports_its_savings(store_dir) -> None:
    before = observe(store_dir)
    with open_admin(store_dir) as store:
        paged = [m for m in store.admin.iter_manifests() if not all(is_dense(e) for e in m.entries)]
        assert sorted(m.session_id for m in paged) == ["s-paged-affine", "s-paged-f32"]
        n_blobs = store.stats()["chunks"]  # chunks
        report = compact(store, cold_after=0.0, grace=0.2)
    assert not report.dry_run and report.skipped_leased == 0, [(s.name, s.skipped, s.note) for s in report.steps]
    assert report.step("densify").count == 2
    assert report.step("densify").bytes_after < report.step("densify").bytes_before
    assert report.step("merge").count > 0
    recompress = report.step("recompress")
    assert recompress.count > 0 and recompress.bytes_after < recompress.bytes_before
    assert report.step("index").count == 1 and report.step("index").bytes_after < report.step("index").bytes_before
    assert report.bytes_after < report.bytes_before and report.ratio == report.bytes_before / report.bytes_after
    assert observe(store_dir) == before
    with open_admin(store_dir) as store:
        assert all(is_dense(e) for m in store.admin.iter_manifests() for e in m.entries)
        assert store.stats()["chunks"] < n_blobs
        assert {meta.encoding for _h, meta in store.admin.iter_chunks()} >= {"zstd"}
        assert store.verify(deep=True) == []
    # a second run finds nothing left to do and changes nothing
    with open_admin(store_dir) as store:
        again = compact(store, cold_after=0.0, grace=0.0)
    assert [s.count for s in again.steps if s.name != "index"] == [0, 0, 0, 0, 0, 0, 0]
    assert observe(store_dir) == before


def test_dry_run_plans_and_changes_nothing(store_dir) -> None:
    snapshot = files(store_dir)
    with open_admin(store_dir) as store:
        plan = compact(store, cold_after=0.0, dry_run=True)
    assert plan.dry_run and plan.step("densify").count == 2 and plan.step("recompress").count > 0
    assert plan.step("recompress").bytes_after < plan.step("recompress").bytes_before
    assert plan.bytes_after < plan.bytes_before
    assert files(store_dir) == snapshot


def test_hot_chunks_stay_raw(store_dir) -> None:
    with open_admin(store_dir) as store:
        report = compact(store, cold_after=3600.0, merge=False, densify_pages=False)
        assert report.step("recompress").count == 0
        assert {meta.encoding for _h, meta in store.admin.iter_chunks()} == {"raw"}


def test_merging_never_touches_shared_chunks() -> None:
    from kvshelf.store.index.schema import ChunkRef

    refs = [ChunkRef(f"{i:032x}", 32 * i, min(32 * i + 32, 100), 10) for i in range(4)]  # last one: 4 tokens
    manifest = type("M", (), {"chunks": refs, "chunk_tokens": 32})()
    owners = {refs[0].hash: 1, refs[1].hash: 1, refs[2].hash: 1, refs[3].hash: 1}
    assert merge_plan(manifest, owners.get, set()) == [[refs[2], refs[3]]]
    owners[refs[2].hash] = 2  # shared with another snapshot: the tail stays alone
    assert merge_plan(manifest, owners.get, set()) == []
    owners[refs[2].hash] = 1
    assert merge_plan(manifest, owners.get, {refs[3].hash}) == []  # leased


def test_leased_snapshots_are_skipped(store_dir) -> None:
    with open_admin(store_dir) as store:
        target = next(m for m in store.admin.iter_manifests() if m.session_id == "s-paged-f32")
        with store.admin.lease(target):  # what a reader holds while it restores
            report = compact(store, cold_after=0.0, grace=0.0)
        assert target.snapshot_id in report.step("densify").skipped
        assert report.skipped_leased >= 1
        after = store.admin.manifest(target.snapshot_id)
        assert after == target and store.admin.chunk_info(target.own[0].hash).encoding == "raw"


def loops_done(result: Path) -> int:
    """How many loops the reader has completed (its progress file; 0 before the first)."""
    try:
        return int(result.with_suffix(".loops").read_text())
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.slow
def test_a_concurrent_reader_never_sees_an_error(store_dir, tmp_path) -> None:
    ready, stop, result = tmp_path / "ready", tmp_path / "stop", tmp_path / "result.json"
    script = Path(__file__).parents[1] / "helpers" / "compaction_reader.py"
    reader = subprocess.Popen([sys.executable, str(script), str(store_dir), str(ready), str(stop), str(result)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert reader.poll() is None, "reader died before its baseline"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with open_admin(store_dir) as store:
            report = compact(store, cold_after=0.0, grace=1.0)
            after = loops_done(result) + 2  # the reader loops twice over the compacted store (counted, not timed)
            while loops_done(result) < after:
                assert reader.poll() is None, "reader died"
                assert time.monotonic() < deadline + 120
                time.sleep(0.05)
            # the reader holds the index open: the LMDB swap must refuse
            assert report.step("index").count == 0 and "another process" in report.step("index").note
    finally:
        stop.write_text("")
        reader.wait(timeout=120)
    outcome = json.loads(result.read_text())
    assert outcome["n_errors"] == 0, outcome["errors"]
    assert outcome["loops"] >= after
    assert report.step("densify").count == 2 and report.step("recompress").count > 0
    with open_admin(store_dir) as store:  # reader gone: now the index shrinks
        assert store.verify(deep=True) == []
        assert compact(store, cold_after=0.0).step("index").note in ("", "already compact")
    assert os.path.exists(store_dir / "index" / "data.mdb")
    assert tokens_for(70, 1)[:40] == list(range(1000, 1040))
