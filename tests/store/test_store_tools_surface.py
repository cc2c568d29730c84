"""The store's surface for offline tools: race-checked in-place rewrites, leases, the open lock and exclusive use,
identity-blind admin handles, zstd levels and hot chunks going back to raw."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pytest
from tools_data import (
    MODEL,
    OTHER,
    make_caches,
    private_copy,
    reads,
    run_cli,
    run_json,
    template_store,
    tokens_for,
)

from kvshelf import open_store  # noqa: E402
from kvshelf.errors import KvShelfError  # noqa: E402
from kvshelf.store import StoreBusy  # noqa: E402
from kvshelf.store.base import seams  # noqa: E402
from kvshelf.tools import admin  # noqa: E402
from kvshelf.tools.admin import open_admin  # noqa: E402
from kvshelf.tools.compaction import compact  # noqa: E402

TOOLS = Path(__file__).parents[2] / "kvshelf" / "tools"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return template_store(tmp_path_factory, "surface", kinds=("mla", "paged-f32"))


@pytest.fixture
def store_dir(template, tmp_path) -> Path:
    return private_copy(template, tmp_path)


@pytest.fixture(autouse=True)
def _no_fault_hook():
    yield
    seams.FAULT_HOOK.clear()


def _bits(caches) -> list[bytes]:
    return [a.tobytes() for a in reads(caches)]


def _save_during_manifest_write(root: Path, snapshot_id: str, session: str, tokens, caches) -> threading.Event:
    """Test seam: when the manifest file of ``snapshot_id`` is (re)written — after a rewrite read the old manifest,
    before its transaction — a real save of the same session commits from another thread."""
    fired = threading.Event()

    def hook(path: str, nbytes: int) -> None:
        if fired.is_set() or f"/{snapshot_id}-" not in path or not path.endswith(".pack"):
            return
        fired.set()
        errors = []

        def save():
            try:
                with open_store(root, identity=MODEL, chunk_tokens=32) as other:
                    other.save(session, tokens, caches)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        worker = threading.Thread(target=save)
        worker.start()
        worker.join(60)
        assert not errors, errors

    seams.FAULT_HOOK.append(hook)
    return fired


def test_replace_manifest_loses_cleanly_to_a_save_committed_after_its_read(store_dir) -> None:
    newer = tokens_for(90, 42)
    with open_store(store_dir, identity=MODEL, chunk_tokens=32) as store:
        sid = next(s.snapshot_id for s in store.sessions() if s.session_id == "s-mla")
        old = store.admin.manifest(sid)
        fired = _save_during_manifest_write(store_dir, sid, "s-mla", newer, make_caches("mla", 90, 42))
        assert store.admin.replace_manifest(sid, old) is False  # the same manifest, but the session moved on meanwhile
        assert fired.is_set()
        seams.FAULT_HOOK.clear()
        r = store.restore("s-mla")
        assert r.tokens == newer and _bits(r.caches) == _bits(make_caches("mla", 90, 42))
        assert store.verify(deep=True) == []
        assert not list((store_dir / "packs").glob(f"{sid}-*.pack"))  # the losing rewrite's pack was unlinked


def test_compaction_skips_a_snapshot_saved_again_during_its_rewrite(store_dir) -> None:
    newer = tokens_for(75, 43)
    with open_store(store_dir, identity=MODEL, chunk_tokens=32) as store:
        sid = next(s.snapshot_id for s in store.sessions() if s.session_id == "s-paged-f32")
        mla_before = _bits(store.restore("s-mla").caches)
    n_blobs = sum(1 for _ in (store_dir / "packs").glob("*.pack"))
    fired = _save_during_manifest_write(store_dir, sid, "s-paged-f32", newer, make_caches("paged-f32", 75, 43))
    with open_admin(store_dir) as store:
        report = compact(store, cold_after=3600.0, grace=0.0, compact_index=False)
        assert fired.is_set()
        seams.FAULT_HOOK.clear()
        densify = report.step("densify")
        assert densify.count == 0 and len(densify.skipped) == 1
        assert densify.skipped[0].startswith(sid) and "saved again" in densify.skipped[0]
        assert store.verify(deep=True) == []
        assert store.gc(dry_run=True).orphan_objects == []  # the rewrite's own blobs were unlinked
    with open_store(store_dir, identity=MODEL, chunk_tokens=32) as store:
        r = store.restore("s-paged-f32")
        assert r.tokens == newer and _bits(r.caches) == _bits(make_caches("paged-f32", 75, 43))
        assert _bits(store.restore("s-mla").caches) == mla_before
    assert sum(1 for _ in (store_dir / "packs").glob("*.pack")) < n_blobs + 4


def test_a_reader_holding_a_manifest_rewritten_in_place_reads_the_new_one(store_dir) -> None:
    """A reader that read a manifest just before compaction rewrote that snapshot must not lease blobs that are
    already unreferenced (and maybe unlinked): it notices in the lease transaction, re-reads, gets the same bits."""
    with open_store(store_dir, identity=MODEL, chunk_tokens=32) as first:
        want = _bits(first.restore("s-paged-f32").caches)
    with open_store(store_dir, identity=MODEL, chunk_tokens=32) as reader:
        sid = next(s.snapshot_id for s in reader.sessions() if s.session_id == "s-paged-f32")
        stale = reader.admin.manifest(sid)
        with open_admin(store_dir) as store:  # rewrites the snapshot, then its gc unlinks the replaced blobs
            assert compact(store, cold_after=3600.0, grace=0.0, merge=False,
                           compact_index=False).step("densify").count == 1
        assert reader.admin.manifest(sid) != stale
        entries, arrays = reader.admin.read_arrays(stale, stale.length)  # the window between reading and leasing
        caches = [reader.provider.for_entry(e).load(e, a, verify=False) for e, a in zip(entries, arrays)]
        assert _bits(caches) == want
        assert reader.verify(deep=True) == []
        assert reader.stats()["quarantined"] == 0


def test_lease_keeps_blobs_from_rewrites_and_releases_without_a_use(store_dir) -> None:
    with open_store(store_dir, identity=MODEL, chunk_tokens=32) as store:
        sid = next(s.snapshot_id for s in store.sessions() if s.session_id == "s-mla")
        used = store.admin.summaries()[sid].last_used_ns
        with store.admin.lease(sid) as m:
            assert m.snapshot_id == sid and store.admin.leased_hashes() >= {r.hash for r in m.all_chunks}
            assert store.admin.rewrite_chunk(m.chunks[0].hash, "zstd") is None  # leased: skipped
        assert store.admin.leased_hashes() == set()
        assert store.admin.rewrite_chunk(m.chunks[0].hash, "zstd") is not None
        assert store.admin.summaries()[sid].last_used_ns == used
        with pytest.raises(KvShelfError, match="not in the store"):
            with store.admin.lease("0" * 32):
                pass


def test_admin_handle_is_identity_blind(store_dir) -> None:
    with open_store(store_dir, admin=True) as store:
        summaries = store.admin.summaries()
        by_session = {(s.namespace, s.session_id) for s in summaries.values()}
        assert by_session == {("", "s-mla"), ("", "s-paged-f32"), ("", "s-mla-copy"), ("tenant", "s-tenant"),
                              ("", "s-other")}
        assert set(summaries) == {m.snapshot_id for m in store.admin.iter_manifests()}
        for call in (lambda: store.save("x", [1, 2], make_caches("mla", 2, 1)), lambda: store.restore("s-mla"),
                     lambda: store.lookup([1, 2, 3]), lambda: store.sessions(), lambda: store.delete("s-mla"),
                     lambda: store.restore_snapshot(next(iter(summaries)))):
            with pytest.raises(KvShelfError, match="identity-blind"):
                call()
        assert store.stats()["snapshots_all_identities"] == 5 and store.stats()["model_id"] is None
        rows = admin.list_sessions(store)
        assert {r["snapshot_id"]: r["last_used_at"] for r in rows} == {
            sid: s.last_used_ns / 1e9 for sid, s in summaries.items()}
    with pytest.raises(TypeError, match="identity"):
        open_store(store_dir)
    with pytest.raises(ValueError, match="identity-blind"):
        open_store(store_dir, identity=OTHER, admin=True)


def test_no_tools_module_reaches_into_the_store() -> None:
    offenders = []
    for path in sorted(TOOLS.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bstore\.(index\.)?_[a-z]", line) or re.search(r"\bStore\._[a-z]", line):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert offenders == []


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvshelf import Identity, open_store
    root, ready, close_now, done = (Path(a) for a in sys.argv[1:5])
    store = open_store(root, identity=Identity("holder"))
    ready.write_text("")
    while not close_now.exists():
        time.sleep(0.02)
    store.close()
    done.write_text("")
    while True:  # alive, but no longer has the store open (killed by the test, never timed out)
        time.sleep(1)
""")

OPENER = textwrap.dedent("""
    import sys, time
    from kvshelf import Identity, open_store
    from kvshelf.store import StoreBusy
    from kvshelf.store.liveness import open_lock as openlock
    openlock.OPEN_TIMEOUT = 0.3
    try:
        open_store(sys.argv[1], identity=Identity("opener")).close()
        print("opened")
    except StoreBusy as exc:
        print("busy:", exc)
""")


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)


def test_the_open_lock_says_exactly_whether_another_process_has_the_store_open(store_dir, tmp_path) -> None:
    ready, close_now, done = tmp_path / "ready", tmp_path / "close", tmp_path / "done"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(store_dir), str(ready), str(close_now), str(done)])
    try:
        _wait_for(ready, holder)
        with open_admin(store_dir) as store:
            with pytest.raises(StoreBusy, match="another process"):
                with store.admin.exclusive():
                    pass
            step = compact(store, cold_after=3600.0, merge=False, densify_pages=False).step("index")
            assert step.count == 0 and step.note.startswith("skipped: another process has the store")
            with pytest.raises(StoreBusy, match="another process"):
                store.rebuild_index()
            second = open_store(store_dir, identity=MODEL)
            try:
                with pytest.raises(StoreBusy, match="other store handles in this process"):
                    with store.admin.exclusive():
                        pass
            finally:
                second.close()
            close_now.write_text("")
            _wait_for(done, holder)  # the holder process lives on, with the store closed
            assert holder.poll() is None
            with store.admin.exclusive():  # now exact: nobody else has it open
                opener = subprocess.run([sys.executable, "-c", OPENER, str(store_dir)], capture_output=True,
                                        text=True, timeout=60)
                assert opener.stdout.startswith("busy:") and "held exclusively" in opener.stdout, opener
            opener = subprocess.run([sys.executable, "-c", OPENER, str(store_dir)], capture_output=True, text=True,
                                    timeout=60)
            assert opener.stdout.strip() == "opened", opener
            assert store.rebuild_index() == 5
            step = compact(store, cold_after=3600.0, merge=False, densify_pages=False).step("index")
            assert step.note in ("", "already compact")
            assert store.verify(deep=True) == []
    finally:
        holder.kill()
        holder.wait()


def _kvz_sizes(root: Path) -> int:
    with open_store(root, admin=True) as store:
        return sum(meta.stored_bytes for _h, meta in store.admin.iter_chunks() if meta.encoding == "zstd")


def test_zstd_level_is_used_and_reaches_the_cli(store_dir, tmp_path) -> None:
    fast, best = tmp_path / "fast", tmp_path / "best"
    shutil.copytree(store_dir, fast)
    shutil.copytree(store_dir, best)
    with open_store(store_dir, admin=True) as store:
        h = next(m for m in store.admin.iter_manifests() if m.session_id == "s-mla").chunks[0].hash
        low = store.admin.rewrite_chunk(h, "zstd", level=1)
        store.admin.rewrite_chunk(h, "raw")
        high = store.admin.rewrite_chunk(h, "zstd", level=19)
        assert low is not None and high is not None and high < low
        assert store.admin.chunk_info(h).stored_bytes == high and store.verify(deep=True) == []
        with pytest.raises(ValueError, match="1..22"):
            store.admin.rewrite_chunk(h, "raw", level=0)
    a = run_json("compact", "--cold-after", "0s", "--level", "1", "--store", str(fast))
    b = run_json("compact", "--cold-after", "0s", "--level", "19", "--store", str(best))
    step = {s["name"]: s for s in a["steps"]}["recompress"], {s["name"]: s for s in b["steps"]}["recompress"]
    assert step[0]["count"] == step[1]["count"] > 0
    assert step[1]["bytes_after"] < step[0]["bytes_after"]
    assert _kvz_sizes(best) < _kvz_sizes(fast)
    refused = run_cli("compact", "--level", "23", "--store", str(fast))
    assert refused.returncode == 2 and "1-22" in refused.stderr


def test_zstd_chunks_used_again_stay_zstd_when_raw_would_make_the_store_bigger(store_dir) -> None:
    """Hot zstd chunks would go back to raw for zero-copy restores, but only within space the same compaction gave
    back: compaction never ends with a bigger store. Here nothing else is given back, so they stay zstd (each named
    as skipped with the reason), and the plan says the same."""
    with open_admin(store_dir) as store:
        compact(store, cold_after=0.0, grace=0.0, merge=False, densify_pages=False, compact_index=False)
        assert {meta.encoding for _h, meta in store.admin.iter_chunks()} == {"zstd"}
    with open_store(store_dir, identity=OTHER) as other:
        want = _bits(other.restore("s-other").caches)  # these chunks are hot again
        manifest_hot = other.admin.manifest(other.sessions()[0].snapshot_id)
    with open_admin(store_dir) as store:
        only = {"merge": False, "densify_pages": False, "compact_index": False}  # merging would rewrite s-other
        hot = {r.hash for r in manifest_hot.all_chunks}
        used = {h: meta.last_used_ns for h, meta in store.admin.iter_chunks()}
        last_cold, first_hot = max(t for h, t in used.items() if h not in hot), min(used[h] for h in hot)
        assert last_cold < first_hot  # the restore came after every other use
        # compaction's "now" is fixed (its clock), so the hot window can end exactly halfway between the last cold
        # use and the restore: no waiting for chunks to age, however fast or slow the machine
        now = time.time()
        cold_after = now - (last_cold + first_hot) / 2e9
        plan = compact(store, cold_after=cold_after, dry_run=True, clock=lambda: now, **only)
        report = compact(store, cold_after=cold_after, grace=0.0, clock=lambda: now, **only)
        step = report.step("decompress")
        assert step.count == 0 == plan.step("decompress").count
        assert {s.split(":")[0] for s in step.skipped} == hot and all("bigger" in s for s in step.skipped)
        assert report.step("recompress").count == 0 and report.bytes_after <= report.bytes_before
        assert {meta.encoding for _h, meta in store.admin.iter_chunks()} == {"zstd"}
        assert store.verify(deep=True) == []
    with open_store(store_dir, identity=OTHER) as other:
        assert _bits(other.restore("s-other").caches) == want


def test_replace_manifest_refuses_another_id_or_session(store_dir) -> None:
    from kvshelf.errors import InvalidCacheState

    with open_store(store_dir, admin=True) as store:
        m = next(m for m in store.admin.iter_manifests() if m.session_id == "s-mla")
        with pytest.raises(InvalidCacheState, match="keeps the snapshot id"):
            store.admin.replace_manifest(m.snapshot_id, msgspec.structs.replace(m, snapshot_id="1" * 32))
        with pytest.raises(InvalidCacheState, match="keeps the session"):
            store.admin.replace_manifest(m.snapshot_id, msgspec.structs.replace(m, session_id="elsewhere"))
        changed = msgspec.structs.replace(m, created_at=m.created_at + 1)
        assert store.admin.replace_manifest(m.snapshot_id, changed, expected=msgspec.structs.replace(m, trimmable=False)) \
            is False  # not the manifest the rewrite was derived from
        assert store.admin.manifest(m.snapshot_id) == m
        assert store.admin.replace_manifest(m.snapshot_id, changed, expected=m) is True
        assert store.admin.manifest(m.snapshot_id) == changed
        assert store.verify(deep=True) == []
