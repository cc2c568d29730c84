"""Concurrency: four processes run mixed save/restore/lookup/restore_prefix/restore_batch on one store for 30 s.

Each worker checks every restore bit-exact itself and reports through its exit code and a JSON result file; the
test then checks the store as a whole: exactly the sessions the workers saved, each restoring bit-exact, verify clean.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import store_workers as sw

WORKER = Path(sw.__file__)
PROCESSES = 4
SECONDS = 30.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_processes_mixed_traffic_for_30_seconds(tmp_path: Path) -> None:
    seed = int(os.environ.get("KVSHELF_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"\nconcurrency test seed {seed} (set KVSHELF_TEST_SEED={seed} to replay)")
    store_dir = tmp_path / "store"
    procs = []
    for k in range(PROCESSES):
        result = tmp_path / f"worker{k}.json"
        cmd = [sys.executable, str(WORKER), "mixed", "--store", str(store_dir), "--seed", str(seed + k),
               "--seconds", str(SECONDS), "--result", str(result)]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), result))

    own: dict[str, int] = {}
    shared: set[str] = set()
    totals: dict[str, int] = {}
    errors: dict[int, list[str]] = {}
    for k, (proc, result) in enumerate(procs):
        _, err = proc.communicate(timeout=SECONDS + 120)
        assert result.exists(), f"worker {k} wrote no result (exit {proc.returncode}): {err}"
        report = json.loads(result.read_text())
        if report["errors"] or proc.returncode != 0:
            errors[k] = report["errors"] + ([err] if err else [])
        own.update(report["own"])
        shared.update(report["shared"])
        for op, n in report["counts"].items():
            totals[op] = totals.get(op, 0) + n
    print(f"operations across {PROCESSES} workers: {totals}")
    assert errors == {}, "\n".join(f"worker {k}: {e}" for k, es in errors.items() for e in es)
    for op in ("save", "restore", "lookup", "restore_prefix", "restore_batch"):
        assert totals[op] > 0, f"no {op} ran in {SECONDS} s: {totals}"

    with sw.open_test_store(store_dir) as store:
        assert store.verify(deep=True) == []
        ids = sw.session_ids(store)
        assert ids == sorted(set(own) | shared)
        for session in ids:
            r = store.restore(session)
            if session in own:
                assert r.length == own[session], f"{session}: length {r.length}, its worker last saved {own[session]}"
            assert list(r.tokens) == sw.session_tokens(session, r.length)
            assert sw.mismatch(r.caches, session, r.length) is None
