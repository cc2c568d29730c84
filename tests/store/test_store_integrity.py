"""Integrity, incremental saves, async writes, budget, leases, gc and index rebuild — each through the public API."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time

import pytest
from codec_cases import CASES_BY_ID
from store_cases import chunk_file, flip_chunk_byte, open_test_store, same_caches, session, token_ids

from kvshelf.errors import CorruptData, SnapshotNotFound, StoreFull
from kvshelf.store.base import seams

MLA = CASES_BY_ID["mla-f32-nodsa"]
PER_TOKEN = 2 * (64 + 32) * 4  # two f32 MLA layers of widths 64 + 32


def mla(n, seed=0):
    return session(MLA, (n,), seed)


def packs_on_disk(root):
    return sorted((root / "packs").glob("*.pack"))


@pytest.fixture(autouse=True)
def _no_fault_hook():
    yield
    seams.FAULT_HOOK.clear()


def test_restore_prefix_reads_only_the_chunks_covering_the_prefix(tmp_path):
    tokens = token_ids(100)
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        store.save("a", tokens, mla(100))
        before = dict(store.counters)
        r = store.restore_prefix(tokens[:20] + [1])
        assert r.length == 20
        assert store.counters["chunks_read"] - before["chunks_read"] == 2  # [0, 16) and [16, 32)
        assert store.counters["bytes_read"] - before["bytes_read"] == 32 * PER_TOKEN
        before = dict(store.counters)
        store.restore("a")
        assert store.counters["chunks_read"] - before["chunks_read"] == 7
        assert store.counters["bytes_read"] - before["bytes_read"] == 100 * PER_TOKEN
        assert store.verify(deep=True) == []


def test_saving_a_grown_session_writes_only_new_chunks(tmp_path):
    tokens = token_ids(80)
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        first = store.save("a", tokens[:40], session(MLA, (40,)))
        assert (first.bytes_written, first.bytes_reused) == (40 * PER_TOKEN, 0)
        grown = session(MLA, (40, 40))
        second = store.save("a", tokens, grown)
        # cut where the first save cut: its tail [32, 40) stays a chunk, only the 40 new rows are written
        assert (second.bytes_written, second.bytes_reused) == (40 * PER_TOKEN, 40 * PER_TOKEN)
        assert (second.chunks_written, second.chunks_reused) == (3, 3)
        again = store.save("b", tokens, session(MLA, (40, 40)))  # cut where "a" was: the same chunks
        assert (again.bytes_written, again.bytes_reused) == (0, 80 * PER_TOKEN)
        assert len(store.sessions()) == 2 and store.stats()["chunks"] == 6
        live = {store.admin.chunk_location(h)[0] for h, _m in store.admin.iter_chunks()}
        assert len(live) == 2 and {p.name for p in packs_on_disk(tmp_path / "s")} >= {n.split("/")[1] for n in live}
        same_caches(store.restore("a").caches, session(MLA, (40, 40)))
        assert store.verify(deep=True) == []


def test_corrupt_chunk_raises_names_it_and_quarantines_only_that_snapshot(tmp_path):
    shared = token_ids(64)
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        a = store.save("a", shared + token_ids(36, seed=1), session(MLA, (64, 36), seed=0))
        b = store.save("b", shared + token_ids(20, seed=2), session(MLA, (64, 20), seed=0))
        assert b.bytes_reused == 64 * PER_TOKEN
        bad = store.admin.manifest(a.snapshot_id).chunks[-1]  # a's own last chunk
        flip_chunk_byte(store, bad.hash)
        assert [f.kind for f in store.verify(deep=False)] == []
        assert [(f.kind, f.where) for f in store.verify(deep=True)] == [("corrupt-chunk", f"chunk {bad.hash}")]
        with pytest.raises(CorruptData, match=rf"session 'a' .*chunk {bad.hash} covering tokens \[96, 100\)"):
            store.restore("a")
        with pytest.raises(CorruptData, match="quarantined"):
            store.restore("a")
        assert store.lookup(shared + token_ids(36, seed=1)).session_id == "b"
        same_caches(store.restore("b").caches, session(MLA, (64, 20), seed=0))
        assert {s.session_id for s in store.sessions()} == {"b"}
        assert store.stats()["quarantined_sessions"] == 1
        assert (tmp_path / "s" / "tomb" / f"{a.snapshot_id}.quarantined").exists()  # the evidence: why, and when
        # issue 12: the quarantined snapshot stays a finding naming its session, and its bytes stay as evidence
        assert [(f.kind, f.sessions) for f in store.verify(deep=True)] == [("quarantined", ("a",))]
        assert os.path.exists(chunk_file(store, bad.hash)[0]) if store.admin.chunk_info(bad.hash) else True
        assert store.gc(dry_run=False).orphan_objects == []  # gc keeps the evidence while the record exists
        assert store.drop_quarantined(a.snapshot_id)  # the operator's decision
        store.gc(dry_run=False)
        assert store.verify(deep=True) == []  # the bad chunk was a's alone: reclaimed by gc after the drop
        store.save("a", shared, session(MLA, (64,), seed=0))  # a new save of the session clears the quarantine
        assert store.restore("a").length == 64
        assert store.verify(deep=True) == []


def test_truncated_blob_is_corrupt_data(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        info = store.save("a", token_ids(40), mla(40))
        path, offset, length = chunk_file(store, store.admin.manifest(info.snapshot_id).chunks[-1].hash)
        with open(path, "r+b") as f:
            f.truncate(offset + length - 100)  # the last chunk (and the pack's trailer) cut short
        with pytest.raises(CorruptData, match="truncated"):
            store.restore("a")
        # issue 12: a quarantined snapshot stays a finding (naming its session) until an operator drops it
        assert store.sessions() == [] and [(f.kind, f.sessions) for f in store.verify(deep=True)] == [
            ("quarantined", ("a",))]
        store.delete("a")  # the operator's drop, by session
        store.gc(dry_run=False)
        assert store.verify(deep=True) == []


def _enospc(path, nbytes):
    raise OSError(errno.ENOSPC, "No space left on device", path)


def test_save_async_failure_surfaces_in_flush_and_leaves_the_store_consistent(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        store.save("a", token_ids(40), mla(40))
        seams.FAULT_HOOK.append(_enospc)
        fut = store.save_async("b", token_ids(40, seed=1), mla(40, seed=1))
        with pytest.raises(StoreFull, match="no space left"):
            store.flush()
        assert isinstance(fut.exception(), StoreFull)
        store.flush()  # the error was reported once
        seams.FAULT_HOOK.clear()
        assert [s.session_id for s in store.sessions()] == ["a"]
        assert store.verify(deep=True) == []
        fut = store.save_async("b", token_ids(40, seed=1), mla(40, seed=1))
        store.flush()
        assert fut.result().length == 40
        same_caches(store.restore("b").caches, mla(40, seed=1))
        assert store.verify(deep=True) == []


def _wait_blocked_in_submit(t: threading.Thread, timeout: float = 60.0) -> None:
    """Until ``t`` is parked in ``BackgroundWriter.submit``'s condition wait (its stack says so): an event the test
    observes, so the assertion after it holds however slow the machine is."""
    import sys

    deadline = time.monotonic() + timeout
    while True:
        frame = sys._current_frames().get(t.ident)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "submit" in names and "wait" in names:
            return
        assert t.is_alive() and time.monotonic() < deadline, f"the second save_async never blocked: {names}"
        time.sleep(0.001)


def test_save_async_blocks_when_queued_bytes_exceed_the_bound(tmp_path):
    gate = threading.Event()
    seams.FAULT_HOOK.append(lambda path, nbytes: gate.wait(10))
    returned = []
    with open_test_store(tmp_path / "s", chunk_tokens=16, max_pending_bytes=50 * PER_TOKEN) as store:
        store.save_async("a", token_ids(40), mla(40))  # 40 tokens queued, the writer blocks on the gate

        def second():
            store.save_async("b", token_ids(40, seed=1), mla(40, seed=1))
            returned.append(time.monotonic())

        t = threading.Thread(target=second)
        t.start()
        _wait_blocked_in_submit(t)  # observed, not slept: the thread is parked in the writer's bound
        assert returned == [] and store.stats()["pending_bytes"] == 40 * PER_TOKEN
        gate.set()
        t.join(10)
        store.flush()
        assert returned and {s.session_id for s in store.sessions()} == {"a", "b"}
        assert store.verify(deep=True) == []


def test_budget_evicts_least_recently_used_whole_snapshots(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16, max_bytes=int(2.5 * 48 * PER_TOKEN)) as store:
        for name, seed in (("a", 1), ("b", 2)):
            store.save(name, token_ids(48, seed=seed), mla(48, seed=seed))
        store.restore("a")  # b is now the least recently used
        store.save("c", token_ids(48, seed=3), mla(48, seed=3))
        assert {s.session_id for s in store.sessions()} == {"a", "c"}
        assert store.stats()["stored_bytes"] <= store.max_bytes and store.counters["evicted"] == 1
        assert store.lookup(token_ids(48, seed=2)) is None
        same_caches(store.restore("a").caches, mla(48, seed=1))
        with pytest.raises(StoreFull, match="more than the store budget"):
            store.save("huge", token_ids(200, seed=4), mla(200, seed=4))
        assert store.verify(deep=True) == []


def test_leased_snapshot_is_not_evicted_and_keeps_its_chunks(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16, max_bytes=int(1.5 * 48 * PER_TOKEN)) as store:
        info = store.save("a", token_ids(48, seed=1), mla(48, seed=1))
        manifest = store.admin.manifest(info.snapshot_id)
        with store.admin.lease(manifest):  # what a restore in flight holds
            store.save("b", token_ids(48, seed=2), mla(48, seed=2))  # over budget, but a is leased
            assert {s.session_id for s in store.sessions()} == {"a", "b"}
            files = {chunk_file(store, r.hash)[0] for r in manifest.chunks}
            store.delete("a")  # even an explicit delete leaves a reader's chunks on disk
            assert all(os.path.exists(f) for f in files)
        # the reader is done: what died meanwhile is left for gc (a release never unlinks), which reclaims it
        report = store.gc(dry_run=False)
        assert report.orphan_objects and not any(os.path.exists(f) for f in files)
        assert store.verify(deep=True) == []


def test_restores_racing_evictions_never_lose_a_chunk(tmp_path):
    errors = []
    with open_test_store(tmp_path / "s", chunk_tokens=16) as reader, \
            open_test_store(tmp_path / "s", chunk_tokens=16, max_bytes=3 * 64 * PER_TOKEN) as writer:
        writer.save("keep", token_ids(64), mla(64))
        stop, first = threading.Event(), threading.Event()
        restores = []

        def restore_loop():
            while not stop.is_set():
                try:
                    r = reader.restore("keep")
                    assert r.length == 64
                    restores.append(1)
                except SnapshotNotFound:
                    pass
                except Exception as exc:  # a CorruptData here would mean a chunk vanished mid-read
                    errors.append(exc)
                first.set()

        t = threading.Thread(target=restore_loop)
        t.start()
        assert first.wait(60)  # the reader is running before the evicting saves start (counted work, no clock)
        for k in range(8):  # each save over budget evicts: 8 evictions racing the reader's loop
            writer.save(f"n{k}", token_ids(64, seed=k + 10), mla(64, seed=k + 10))
        stop.set()
        t.join()
        assert errors == [] and writer.counters["evicted"] >= 5
        assert writer.verify(deep=True) == []


def test_gc_dry_run_reports_and_removes_nothing(tmp_path):
    root = tmp_path / "s"
    with open_test_store(root, chunk_tokens=16) as store:
        store.save("a", token_ids(40), mla(40))
        orphan = f"packs/{'ab' * 16}.pack"
        src = packs_on_disk(root)[0]
        shutil.copy(src, root / orphan)  # crash residue: a pack written, never committed
        (root / "tmp" / "999999999-dead.tmp").write_bytes(b"x")
        (root / "blobs" / "manifests").mkdir(mode=0o700, parents=True)
        (root / "blobs" / "manifests" / f"{'cd' * 16}.msgpack").write_bytes(b"\x80")  # a v1 writer's residue
        kinds = sorted(f.kind for f in store.verify())
        assert kinds == ["orphan-manifest", "orphan-object"]
        dry = store.gc(dry_run=True)
        assert (dry.orphan_objects, dry.orphan_manifests, dry.tmp_files) == ([orphan], ["cd" * 16],
                                                                           ["999999999-dead.tmp"])
        assert dry.bytes == os.path.getsize(src)
        assert (root / orphan).exists() and (root / "tmp" / "999999999-dead.tmp").exists()
        done = store.gc(dry_run=False)
        assert done.orphan_objects == [orphan] and not (root / orphan).exists()
        assert not (root / "tmp" / "999999999-dead.tmp").exists()
        assert store.gc(dry_run=True).orphan_objects == []
        same_caches(store.restore("a").caches, mla(40))
        assert store.verify(deep=True) == []


def test_rebuild_index_from_the_blob_directory_alone(tmp_path):
    root = tmp_path / "s"
    shared = token_ids(50)
    with open_test_store(root, chunk_tokens=16) as store:
        store.save("a", shared + token_ids(10, seed=1), session(MLA, (50, 10)))
        store.save("b", shared + token_ids(30, seed=2), session(MLA, (50, 30), seed=0), namespace="t")
        store.save("a", shared + token_ids(20, seed=1), session(MLA, (50, 20)))  # replaces a's first snapshot
        before = {(s.session_id, s.namespace, s.snapshot_id, s.length) for s in store.sessions()}
    for name in ("data.mdb", "lock.mdb"):
        os.unlink(root / "index" / name)
    with open_test_store(root, chunk_tokens=16) as store:
        assert store.sessions() == []
        assert store.rebuild_index() == 2
        assert {(s.session_id, s.namespace, s.snapshot_id, s.length) for s in store.sessions()} == before
        same_caches(store.restore("a").caches, session(MLA, (50, 20)))
        same_caches(store.restore("b", namespace="t").caches, session(MLA, (50, 30), seed=0))
        assert store.lookup(shared + [7], namespace="t").session_id == "b"
        assert store.verify(deep=True) == []
