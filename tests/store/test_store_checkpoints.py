"""Checkpoints in the store (issue 22): the state after a session's first ``k`` tokens, beside its snapshot.

``lookup`` equals a brute-force oracle of the usable-prefix rule over every snapshot *and* every checkpoint (a
checkpoint is a snapshot of ``tokens[:k]`` of its session's trimmability and floor); a checkpoint never outlives
its session (delete, eviction, quarantine, ``rebuild_index``), is not listed as a session, and verify/gc stay clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lookup_oracle import IDENTITY, PROVIDER, caches, oracle, stores

from kvshelf import open_store
from kvshelf.errors import InvalidCacheState, SnapshotNotFound

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    with open_store(tmp_path_factory.mktemp("ckpt-oracle") / "s", identity=IDENTITY, provider=PROVIDER,
                    chunk_tokens=64) as store:
        yield store


@st.composite
def stores_with_checkpoints(draw):
    snaps, prompt = draw(stores())
    with_ks = []
    for tokens, trimmable, floor in snaps:
        ks = sorted(set(draw(st.lists(st.integers(1, max(1, len(tokens) - 1)), max_size=4))))
        with_ks.append((tokens, trimmable, floor, [k for k in ks if k < len(tokens)]))
    return with_ks, prompt


@settings(max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=stores_with_checkpoints())
def test_lookup_equals_the_oracle_over_snapshots_and_checkpoints(shared_store, case) -> None:
    with_ks, prompt = case
    store, ns = shared_store, uuid.uuid4().hex
    everything = []
    for i, (tokens, trimmable, floor, ks) in enumerate(with_ks):
        store.save(f"s{i}", tokens, caches(len(tokens), trimmable, floor), namespace=ns,
                   checkpoints={k: caches(k, trimmable, min(floor, k)) for k in ks})
        everything.append((tokens, trimmable, floor))
        everything += [(tokens[:k], trimmable, min(floor, k)) for k in ks]
    want = oracle(everything, prompt)
    hit = store.lookup(prompt, namespace=ns)
    assert (0 if hit is None else hit.length) == want, (hit, want)
    if hit is not None:
        tokens, trimmable, floor, ks = with_ks[int(hit.session_id[1:])]  # a checkpoint names its session
        assert tokens[:want] == prompt[:want]
        if hit.checkpoint:
            assert hit.snapshot_length in ks and (trimmable or want == hit.snapshot_length)
        r = store.restore_prefix(prompt, namespace=ns)
        assert r.length == want and r.caches[0].offset == want
    assert sorted(s.session_id for s in store.sessions(ns)) == sorted(f"s{i}" for i in range(len(with_ks)))


def _ring_session(store, sid: str, n: int = 200, ks=(64, 128), ns: str = ""):
    tokens = [(i * 7 + len(sid)) % 50 for i in range(n)]
    store.save(sid, tokens, caches(n, False, 0), namespace=ns, checkpoints={k: caches(k, False, 0) for k in ks})
    return tokens


def test_checkpoint_arguments_and_a_missing_session_are_refused(tmp_path) -> None:
    with open_store(tmp_path / "s", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        with pytest.raises(SnapshotNotFound):
            store.save_checkpoint("nobody", [1, 2, 3], caches(3, False, 0))
        with pytest.raises(InvalidCacheState):
            store.save("a", [1] * 10, caches(10, False, 0), checkpoints={10: caches(10, False, 0)})
        with pytest.raises(ValueError):
            store.save("a\x00ckpt:000000000001", [1], caches(1, False, 0))  # nobody names a checkpoint id
        tokens = _ring_session(store, "a")
        assert [c.length for c in store.list_checkpoints("a")] == [64, 128]
        hit = store.lookup(tokens[:130] + [99])
        assert (hit.session_id, hit.length, hit.checkpoint, hit.snapshot_length) == ("a", 128, True, 128)
        assert store.lookup(tokens + [99]).checkpoint is False


def test_a_session_deleted_while_its_checkpoint_is_written_leaves_no_orphan(tmp_path) -> None:
    """The session is checked before the checkpoint's pack is written and again in the commit's transaction: a
    delete committing in between (held open at the pack write by the write seam) leaves no checkpoint behind."""
    from kvshelf.store.base import seams

    with open_store(tmp_path / "s", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        tokens = _ring_session(store, "a", ks=())
        deleted = []

        def delete_first(path, nbytes) -> None:
            if not deleted and "packs" in str(path):
                store.delete("a")
                deleted.append(True)

        seams.FAULT_HOOK.append(delete_first)
        try:
            with pytest.raises(SnapshotNotFound, match="removed while the checkpoint was saved"):
                store.save_checkpoint("a", tokens[:64], caches(64, False, 0))
        finally:
            seams.FAULT_HOOK.remove(delete_first)
        assert deleted == [True]
        assert store.stats()["snapshots"] == 0 and store.list_checkpoints("a") == []
        assert store.verify(deep=True) == []
        assert store.gc(dry_run=True).orphan_objects == []  # the refused checkpoint's pack was reclaimed at once


def test_verify_reports_an_orphan_checkpoint_and_repair_drops_it(tmp_path) -> None:
    """An index that holds checkpoints without their session (written before the commit re-checked the session, or
    damaged): verify names each, with the session, and repair drops them."""
    from kvshelf.store.liveness import ledger

    with open_store(tmp_path / "s", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        _ring_session(store, "a")
        _ring_session(store, "b", ks=())
        sid = bytes.fromhex(next(s.snapshot_id for s in store.sessions() if s.session_id == "a"))
        store.index.write(lambda txn: ledger.drop(store.index, txn, sid))  # the session alone, no followers
        found = [f for f in store.verify() if f.kind == "orphan-checkpoint"]
        assert [f.sessions for f in found] == [("a",), ("a",)] and "kvshelf repair" in found[0].detail
        report = store.repair(dry_run=True)
        assert len(report.dropped_checkpoints) == 2 and store.stats()["snapshots"] == 3  # a dry run: still there
        report = store.repair(dry_run=False)
        assert len(report.dropped_checkpoints) == 2 and report.remaining == []
        assert store.verify(deep=True) == [] and store.stats()["snapshots"] == 1


def test_eviction_of_a_session_takes_its_checkpoints_along(tmp_path) -> None:
    root = tmp_path / "s"
    with open_store(root, identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        _ring_session(store, "a")
        budget = store.stats()["stored_bytes"] + 2000
    with open_store(root, identity=IDENTITY, provider=PROVIDER, chunk_tokens=64, max_bytes=budget) as store:
        store.save("b", list(range(60, 160)), caches(100, False, 0))  # the LRU victim is a's session (oldest)
        assert [s.session_id for s in store.sessions()] == ["b"]
        assert store.list_checkpoints("a") == [] and store.stats()["snapshots"] == 1
        assert store.verify(deep=True) == []


def test_quarantine_of_a_session_takes_its_checkpoints_along(tmp_path) -> None:
    with open_store(tmp_path / "s", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        tokens = _ring_session(store, "a")
        store.quarantine(store.sessions()[0].snapshot_id, "test: damaged")
        assert store.list_checkpoints("a") == [] and store.lookup(tokens[:130] + [99]) is None
        assert store.stats()["snapshots"] == 0


def test_rebuild_index_never_brings_back_the_checkpoints_of_a_deleted_session(tmp_path) -> None:
    root = tmp_path / "s"
    with open_store(root, identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        _ring_session(store, "gone")
        kept = _ring_session(store, "kept", ks=(64,), ns="t")
        store.delete("gone")
        assert store.list_checkpoints("gone") == []
        assert store.gc(dry_run=False) is not None and store.verify(deep=True) == []
    for name in ("data.mdb", "lock.mdb"):
        os.unlink(root / "index" / name)
    with open_store(root, identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        assert store.rebuild_index() == 2
        assert [s.session_id for s in store.sessions(None)] == ["kept"]
        assert store.list_checkpoints("gone") == []
        assert [c.length for c in store.list_checkpoints("kept", "t")] == [64]
        assert store.lookup(kept[:70] + [99], namespace="t").length == 64
        assert store.verify(deep=True) == []


def test_kvshelf_ls_and_show_list_a_sessions_checkpoints_and_not_as_sessions(tmp_path) -> None:
    root = tmp_path / "s"
    with open_store(root, identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        _ring_session(store, "a")
        snapshot = store.sessions()[0].snapshot_id
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ls = subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", "ls", "--store", str(root), "--json"],
                        capture_output=True, text=True, env=env, timeout=300, check=True)
    rows = json.loads(ls.stdout)["sessions"]
    assert [(r["session_id"], r["checkpoints"]) for r in rows] == [("a", [64, 128])]
    show = subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", "show", "a", "--store", str(root), "--json"],
                          capture_output=True, text=True, env=env, timeout=300, check=True)
    doc = json.loads(show.stdout)
    assert doc["snapshot_id"] == snapshot and [c["tokens"] for c in doc["checkpoints"]] == [64, 128]
    human = subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", "show", "a", "--store", str(root)],
                           capture_output=True, text=True, env=env, timeout=300, check=True)
    assert "checkpoints" in human.stdout and doc["checkpoints"][1]["snapshot_id"] in human.stdout


def test_a_quarantined_checkpoint_goes_alone_and_delete_of_its_session_drops_the_record(tmp_path) -> None:
    with open_store(tmp_path / "s", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        tokens = _ring_session(store, "a")
        first = store.list_checkpoints("a")[0]
        store.quarantine(first.snapshot_id, "test: damaged")
        assert [c.length for c in store.list_checkpoints("a")] == [128]
        assert store.lookup(tokens[:70] + [99]) is None and store.lookup(tokens[:130] + [99]).length == 128
        assert store.stats()["quarantined_sessions"] == 1
        store.delete("a")
        assert store.stats()["quarantined_sessions"] == 0 and store.stats()["snapshots"] == 0
        assert store.gc(dry_run=False).orphan_objects  # the evidence the quarantine kept, reclaimable once dropped
        assert store.verify(deep=True) == []


def test_restore_batch_takes_a_checkpoint_hit_like_any_prefix_hit(tmp_path) -> None:
    with open_store(tmp_path / "s", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        a = _ring_session(store, "a")
        b = _ring_session(store, "bb", ks=(64,))
        hits = [store.lookup(a[:130] + [99]), store.lookup(b[:100] + [99])]
        assert [(h.session_id, h.length, h.checkpoint) for h in hits] == [("a", 128, True), ("bb", 64, True)]
        batch = store.restore_batch(hits)
        assert batch.lengths == [128, 64] and batch.tokens == [a[:128], b[:64]]
