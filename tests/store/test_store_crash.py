"""Durability: a worker process saving sessions is killed with SIGKILL at random moments, again and again.

After every kill the store must open, ``verify(deep=True)`` must find nothing wrong, every indexed session must
restore bit-exact to what the worker fed it (recomputed here from ``(session, length)``), every save the worker saw
return must be there, and ``gc()`` must leave no orphan behind while every snapshot still restores.

The randomness is replayable: the seed is printed; set ``KVSHELF_TEST_SEED`` to rerun the same kill schedule.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import store_workers as sw

WORKER = Path(sw.__file__)
KILLS = 50  # kill points that hit a live worker after it opened the store (early kills come on top)
KILLS_PER_STORE = 5  # then a fresh store, so each check stays cheap


def _seed() -> int:
    return int(os.environ.get("KVSHELF_TEST_SEED", random.SystemRandom().randrange(2**32)))


def _read_log(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _wait_ready(log: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while "ready" not in _read_log(log):
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode} before opening the store: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError("worker did not open the store within 30 s")
        time.sleep(0.005)


def _kill_mid_save(log: Path, proc: subprocess.Popen) -> None:
    """SIGKILL the worker while its log says a save is in flight: when the last line reads ``saving ...`` the worker
    is frozen (SIGSTOP), the log read again, and killed only if it still says so (else resumed) — so the kill is
    inside a save by construction, however the machine is loaded. Returns when the worker was killed or ended."""
    while proc.poll() is None:
        lines = _read_log(log)
        if lines and lines[-1].startswith("saving "):
            os.kill(proc.pid, signal.SIGSTOP)
            lines = _read_log(log)
            if lines[-1].startswith("saving "):
                os.kill(proc.pid, signal.SIGKILL)
                return
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.001)


def blob_files(store_dir: Path) -> set[str]:
    """Every object holding chunks on disk (layout v2: ``packs/<uuid>.pack``), by object name."""
    return {f"packs/{p.name}" for p in (store_dir / "packs").glob("*.pack") if p.is_file()}


RESIDUE = {"orphan-object", "orphan-manifest"}  # what a kill may leave behind; gc's to reclaim, not a fault


def problems_of(findings) -> list:
    """Findings of ``verify`` that are inconsistencies (crash residue excluded)."""
    return [f for f in findings if f.kind not in RESIDUE]


def check_store(
    store_dir: Path, committed: dict[str, int], plans: dict[str, list[int]], touched: set[str]
) -> tuple[int, int]:
    """Every invariant of a store a killed worker left behind; returns (sessions checked, blobs gc removed)."""
    with sw.open_test_store(store_dir) as store:
        found = store.verify(deep=True)
        assert problems_of(found) == []
        orphans = sorted(f.where.split()[-1] for f in found if f.kind == "orphan-object")
        stray_manifests = sorted(f.where.split()[-1] for f in found if f.kind == "orphan-manifest")
        ids = sw.session_ids(store)
        missing = sorted(set(committed) - set(ids))
        assert missing == [], f"saves that returned before the kill are gone: {missing}"
        unplanned = sorted(set(ids) - set(plans))
        assert unplanned == [], f"sessions nobody saved: {unplanned}"

        def check(sessions) -> None:
            for session in sessions:
                r = store.restore(session)
                lengths = plans[session]
                if session in committed:
                    last = lengths.index(committed[session])
                    allowed = lengths[last : last + 2]  # the logged save, or the next one if it committed unlogged
                else:
                    allowed = lengths[:1]
                assert r.length in allowed, f"{session}: restored length {r.length}, expected one of {allowed}"
                assert list(r.tokens) == sw.session_tokens(session, r.length)
                assert sw.mismatch(r.caches, session, r.length) is None

        check(sorted(touched & set(ids)))  # what the killed run wrote; the others are checked after gc below
        before = blob_files(store_dir)
        report = store.gc(dry_run=False)
        after = blob_files(store_dir)
        assert sorted(report.orphan_objects) == orphans
        assert sorted(report.orphan_manifests) == stray_manifests
        assert sorted(before - after) == orphans
        again = store.gc(dry_run=True)
        assert (again.orphan_objects, again.orphan_manifests, again.tmp_files) == ([], [], []), f"gc left {again}"
        assert store.verify() == []  # blobs were re-hashed above; gc only removed unreferenced ones
        check(ids)
        for session in ids[:: max(1, len(ids) // 3)]:  # the prefix index serves what survived, cut anywhere
            r = store.restore(session)
            cut = 1 + sw.xxh_int(session) % r.length if sw.caches_trimmable() else r.length
            prefix = store.restore_prefix(sw.session_tokens(session, cut) + [sw.VOCAB + 1])
            assert prefix is not None and prefix.length == cut, f"{session}[:{cut}]: {prefix and prefix.length}"
            assert sw.mismatch(prefix.caches, session, cut) is None
        referenced = store.stats()["packs"]
        assert len(after) == referenced, f"{len(after)} packs on disk, {referenced} referenced"
    tmp = store_dir / "tmp"
    assert not tmp.exists() or list(tmp.iterdir()) == [], f"in-flight residue left in {tmp}"
    return len(ids), len(orphans)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_leaves_a_consistent_store(tmp_path: Path) -> None:
    seed = _seed()
    print(f"\ncrash test seed {seed} (set KVSHELF_TEST_SEED={seed} to replay)")
    rng = random.Random(seed)
    kills = early_kills = mid_save = runs = reclaimed = checked = 0
    worker_s = check_s = 0.0
    progress: list[int] = []  # saves completed by each killed run
    started = time.monotonic()
    while kills < KILLS:
        store_dir = tmp_path / f"store{kills // KILLS_PER_STORE}"
        if not store_dir.exists():
            committed: dict[str, int] = {}
            plans: dict[str, list[int]] = {}
        run_seed = rng.randrange(2**31)
        plans.update(sw.planned_lengths(run_seed))
        log = tmp_path / f"run{runs}.log"
        runs += 1
        spawned = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "crash", "--store", str(store_dir), "--seed", str(run_seed), "--log", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        early = rng.random() < 0.15
        targeted = not early and kills % 4 == 0  # a quarter of the kills land inside a save by construction
        try:
            if early:
                time.sleep(rng.uniform(0.0, 0.6))  # anywhere from start-up through open into the first saves
            elif targeted:
                _wait_ready(log, proc)
                time.sleep(rng.uniform(0.0, 0.3))  # which save: any of the plan's
                _kill_mid_save(log, proc)
            else:
                _wait_ready(log, proc)
                time.sleep(rng.uniform(0.0, 0.8))
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # it may still finish on its own just before the signal lands
        finally:
            proc.wait(timeout=30)
        err = proc.stderr.read()
        proc.stderr.close()
        lines = _read_log(log)
        if proc.returncode != 0:  # 0: the worker completed its whole plan before the kill
            assert proc.returncode == -signal.SIGKILL, f"worker ended with {proc.returncode}: {err}"
            if early or "ready" not in lines:
                early_kills += 1
            else:
                kills += 1
                mid_save += bool(lines) and lines[-1].startswith("saving ")
        else:
            assert lines and lines[-1] == "done", f"worker exited 0 without finishing (seed {run_seed}): {err}"
        saved = [line.split() for line in lines if line.startswith("saved ")]
        progress.append(len(saved))
        for _, session, length in saved:
            committed[session] = int(length)
        worker_s += time.monotonic() - spawned
        t0 = time.monotonic()
        touched = set(sw.planned_lengths(run_seed)) & set(plans)
        n, removed = check_store(store_dir, committed, plans, touched)
        check_s += time.monotonic() - t0
        checked += n
        reclaimed += removed
    elapsed = time.monotonic() - started
    print(
        f"{kills} kills after open ({mid_save} mid-save) + {early_kills} early, in {runs} runs, {elapsed:.1f} s; "
        f"saves completed per run {progress}; "
        f"{checked} sessions checked; gc reclaimed {reclaimed} orphan blobs; "
        f"{worker_s:.1f} s in workers, {check_s:.1f} s checking"
    )
    assert kills == KILLS
    assert mid_save >= KILLS // 5, f"only {mid_save} of {kills} kills landed inside a save"
