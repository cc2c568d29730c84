"""Readers' leases live exactly as long as the process holding them — judged by kernel-released locks, never by a PID
(issue 12): a reader in another PID namespace (its PID means nothing here) keeps its chunks on disk through a delete
and a gc; the moment it is killed (SIGKILL: no cleanup ran) its lease is dead, gc reaps its lease file, and the
chunks go. The same without a namespace. The namespace variant skips, with the reason, where ``unshare`` is refused.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from codec_cases import CASES_BY_ID
from host_features import need
from store_cases import open_test_store, session, token_ids

MLA = CASES_BY_ID["mla-f32-nodsa"]
TESTS = Path(__file__).parents[1]

HOLDER = """
import sys, time, pathlib
sys.path[:0] = [{helpers!r}, {repo!r}]
from store_cases import open_test_store
with open_test_store({root!r}, chunk_tokens=16) as store:
    sid = store.sessions()[0].snapshot_id
    with store.admin.lease(sid):
        pathlib.Path({ready!r}).write_text(str(__import__("os").getpid()))
        time.sleep(600)
"""


def _unshare_prefix() -> list[str]:
    need("pid-namespace")  # the variant that calls this is marked host_feature("pid-namespace")
    return [shutil.which("unshare"), "--pid", "--fork"]


NAMESPACES = ["same", pytest.param("own-pid-namespace", marks=pytest.mark.host_feature("pid-namespace"))]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_readers_lease_lives_exactly_as_long_as_its_process(tmp_path, namespace):
    prefix = _unshare_prefix() if namespace != "same" else []
    root = tmp_path / "s"
    with open_test_store(root, chunk_tokens=16) as store:
        info = store.save("a", token_ids(48), session(MLA, (48,)))
        packs = {store.admin.chunk_location(r.hash)[0] for r in store.admin.manifest(info.snapshot_id).all_chunks}
    ready = tmp_path / "ready"
    script = HOLDER.format(helpers=str(TESTS / "helpers"), repo=str(TESTS.parent), root=str(root), ready=str(ready))
    holder = subprocess.Popen([*prefix, sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None, f"the lease holder exited with {holder.returncode}"
            assert time.monotonic() < deadline, "the lease holder never took its lease"
            time.sleep(0.01)
        if namespace != "same":
            assert ready.read_text() in ("1", "2")  # its own PID namespace: that PID is some other process here
        with open_test_store(root, chunk_tokens=16) as store:
            assert store.admin.leased_hashes()  # the other namespace's lease is seen
            store.delete("a")
            report = store.gc(dry_run=False)
            assert report.expired_leases == 0 and report.orphan_objects == []
            assert all((root / name).exists() for name in packs)  # a live reader's chunks stay
            os.killpg(holder.pid, signal.SIGKILL)  # no cleanup runs: only the kernel drops its lock
            holder.wait(30)
            deadline = time.monotonic() + 30  # unshare's forked child (the holder) dies just after unshare itself
            while store.admin.leased_hashes() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert store.admin.leased_hashes() == set()
            report = store.gc(dry_run=False)
            assert report.expired_leases == 1  # its lease file, reaped
            assert sorted(report.orphan_objects) == sorted(packs)
            assert not any((root / name).exists() for name in packs)
            assert not list((root / "leases").glob("*.lease"))
            assert store.verify(deep=True) == []
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(30)
