"""``verify`` streams (issue 12: "gc and verify stream — bounded memory, batched transactions"): manifests and chunk
records are read in short batches, refcounts are counted one partition of the hash space at a time, and a finding is
re-checked in a fresh transaction before it is reported — so a save or delete committing in another process while
verify runs never shows up as damage, and real damage is still found with the tiniest batches and partitions.

The batch size and the refcount partition size are the module's constants, set small here so that a few sessions
take many transactions and several partitions (the same code paths a store of millions of chunks takes).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# tests/helpers: conftest puts it on the path under pytest; this file also runs as a script (the children below)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))

import store_workers as sw  # noqa: E402

from kvshelf.store.base import seams
from kvshelf.store.index import schema as mf  # noqa: E402
from kvshelf.store.integrity import verify_counts as verifying  # noqa: E402
from kvshelf.store.index.schema import ChunkMeta  # noqa: E402


@pytest.fixture
def tiny_batches(monkeypatch):
    monkeypatch.setattr(verifying, "VERIFY_BATCH", 2)
    monkeypatch.setattr(verifying, "COUNT_LIMIT", 4)


def _fill(store, n: int) -> None:
    for j in range(n):
        session = f"f{j % sw.FAMILIES}-v-{j}"
        length = 150 + 40 * j
        store.save(session, sw.session_tokens(session, length), sw.build_caches(session, length))


@given(parts=st.integers(1, 5000), head=st.integers(0, 2**32 - 1))
@settings(max_examples=300, deadline=None)
def test_refcount_partitions_cover_the_hash_space_once(parts, head):
    """Every hash lies in exactly the key range of the partition ``_part`` assigns it, for any partition count."""
    hb = head.to_bytes(4, "big") + bytes(range(12))
    p = verifying._part(hb, parts)
    assert 0 <= p < parts
    start, stop = verifying._range(p, parts)
    assert (start is None or start <= hb) and (stop is None or hb < stop)
    if p + 1 < parts:
        assert verifying._range(p + 1, parts)[0] == stop  # adjacent ranges meet: no hash in none or two


def test_tiny_batches_and_partitions_find_exactly_the_crafted_drift(tmp_path, tiny_batches):
    with sw.open_test_store(tmp_path / "s") as store:
        _fill(store, 6)
        assert verifying.partitions(store.index) > 3  # the refcounts really are counted in several passes
        assert store.verify(deep=True) == []
        victim = sorted(h for h, _m in store.admin.iter_chunks())[-1]  # the last range: every partition is reached
        meta = store.admin.chunk_info(victim)

        def bump(txn):
            txn.put("chunks", bytes.fromhex(victim), mf.encode(ChunkMeta(meta.refs + 2, meta.nbytes, meta.stored_bytes,
                                                               meta.encoding, meta.last_used_ns, meta.pack,
                                                               meta.offset)))

        store.index.write(bump)
        found = store.verify()
        assert [(f.kind, f.where) for f in found] == [("refcount-drift", f"chunk {victim}")]
        assert f"refcount {meta.refs + 2}, referenced by {meta.refs}" in found[0].detail


def churn(store_dir: str, progress: str, stop: str, seed: int) -> int:
    """The concurrent writer: saves (growing sessions, shared family prefixes), re-saves and deletes until the
    ``stop`` file exists, writing how many operations committed to ``progress`` after each."""
    rng = random.Random(seed)
    done, live = 0, {}
    with sw.open_test_store(store_dir) as store:
        while not os.path.exists(stop) and done < 100_000:
            if live and rng.random() < 0.35:
                session = rng.choice(sorted(live))
                store.delete(session)
                del live[session]
            else:
                session = f"f{rng.randrange(sw.FAMILIES)}-w-{rng.randrange(6)}"
                length = live.get(session, 80) + rng.randrange(1, 200)
                if length > sw.MAX_LEN:
                    length = rng.randrange(1, 200)
                store.save(session, sw.session_tokens(session, length), sw.build_caches(session, length))
                live[session] = length
            done += 1
            with open(progress + ".tmp", "w") as fh:
                fh.write(str(done))
            os.replace(progress + ".tmp", progress)
    return 0


def _progress(path: Path) -> int:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.timeout(600)
def test_verify_invents_nothing_while_another_process_saves_and_deletes(tmp_path, tiny_batches):
    """Every verify that runs while a writer process commits saves and deletes is clean (the writer's commits
    land between verify's batches: counts, session pointers, packs unlinked after a delete, packs written but not
    yet committed all change under it); and it still finds real damage planted meanwhile."""
    root = tmp_path / "s"
    with sw.open_test_store(root) as store:
        _fill(store, 3)  # a few sessions the writer never touches
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, __file__, "churn", str(root), str(progress), str(stop), "7"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with sw.open_test_store(root) as store:
            while _progress(progress) < 3 and proc.poll() is None:  # the writer is running and committing
                store.verify()
            overlapped = [0]

            def a_commit_lands_now() -> None:  # between two of verify's batches: wait for the writer's next commit
                if overlapped[0] >= n_verifies[0]:
                    return  # once per verify (its first batch boundary)
                start = _progress(progress)
                for _ in range(6000):
                    if _progress(progress) > start or proc.poll() is not None:
                        break
                    time.sleep(0.01)
                assert _progress(progress) > start, f"the writer made no commit in 60 s: {proc.poll()}"
                overlapped[0] += 1

            n_verifies = [0]
            seams.AFTER_BATCH.append(a_commit_lands_now)
            try:
                for _ in range(40):
                    n_verifies[0] += 1
                    assert store.verify(deep=True) == []
            finally:
                seams.AFTER_BATCH.remove(a_commit_lands_now)
            assert overlapped[0] == 40  # every verify had a commit land between two of its batches
            # real damage planted while the writer runs is still found, and only it: a chunk only f0-v-0 uses
            mine = store.admin.manifest(next(s.snapshot_id for s in store.sessions() if s.session_id == "f0-v-0"))
            victim = mine.chunks[-1].hash
            meta = store.admin.chunk_info(victim)
            store.index.write(lambda txn: txn.put("chunks", bytes.fromhex(victim), mf.encode(ChunkMeta(
                meta.refs + 2, meta.nbytes, meta.stored_bytes, meta.encoding, meta.last_used_ns, meta.pack,
                meta.offset))))
            found = store.verify()
            assert [(f.kind, f.where) for f in found] == [("refcount-drift", f"chunk {victim}")]
            assert proc.poll() is None, proc.stderr.read()
    finally:
        stop.write_text("")
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


if __name__ == "__main__" and sys.argv[1:2] == ["churn"]:
    sys.exit(churn(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))


def slow_remover(store_dir: str, committed: str, go: str) -> int:
    """Delete one session, stopping between the commit and the unlink of what it freed until ``go`` exists."""
    def pause() -> None:
        Path(committed).write_text("")
        for _ in range(12000):  # waits on the test's file (up to 120 s), never on a guess
            if os.path.exists(go):
                return
            time.sleep(0.01)

    seams.BEFORE_UNLINK.append(pause)
    with sw.open_test_store(store_dir) as store:
        store.delete("f1-v-1")
    return 0


def test_a_remover_between_its_commit_and_its_unlink_is_not_residue(tmp_path):
    """A delete in another process has committed and not yet unlinked what it freed: those packs are dead in the
    index and still on disk, like crash residue. verify must wait for the remover (the removers' lock), not guess:
    the remover is released only at the moment verify starts confirming, so a verify that does not wait would see
    them and report them."""
    root = tmp_path / "s"
    with sw.open_test_store(root) as store:
        _fill(store, 3)
    committed, go = tmp_path / "committed", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, __file__, "slow-remover", str(root), str(committed), str(go)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(12000):
            if committed.exists() or proc.poll() is not None:
                break
            time.sleep(0.01)
        assert committed.exists(), proc.stderr.read() if proc.poll() is not None else "the remover never committed"
        released = []
        seams.BEFORE_CONFIRM.append(lambda: (go.write_text(""), released.append(1)))
        try:
            with sw.open_test_store(root) as store:
                assert [s.session_id for s in store.sessions() if s.session_id == "f1-v-1"] == []  # committed
                assert store.verify(deep=True) == []
                assert released == [1]  # there were residue candidates (the remover's packs), and they were waited for
                assert store.verify(deep=True) == []
        finally:
            seams.BEFORE_CONFIRM.clear()
    finally:
        go.write_text("")
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


if __name__ == "__main__" and sys.argv[1:2] == ["slow-remover"]:
    sys.exit(slow_remover(sys.argv[2], sys.argv[3], sys.argv[4]))
