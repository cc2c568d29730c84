"""A writer's in-flight tmp file lives exactly as long as its process — judged by the ``flock`` its writer holds,
never by a PID (issue 12: "reproduced with ``unshare --pid``: a live writer's tmp file was deleted"). A save in
another PID namespace is parked mid-write (its ``localbytes.pwrite_all`` wrapped to wait after writing); this
namespace's gc must leave its tmp file (and the save gate it holds makes gc skip the orphan sweep); once the writer
is SIGKILLed the kernel drops its lock and gc reaps the file. Skips, with the reason, where ``unshare`` is refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from codec_cases import CASES_BY_ID
from store_cases import open_test_store, session, token_ids
from test_store_liveness import NAMESPACES, _unshare_prefix

MLA = CASES_BY_ID["mla-f32-nodsa"]
TESTS = Path(__file__).parents[1]

WRITER = """
import os, sys, time, pathlib
sys.path[:0] = [{helpers!r}, {repo!r}]
from codec_cases import CASES_BY_ID
from store_cases import open_test_store, session, token_ids
from kvshelf.store.objects import local as localbytes
write = localbytes.pwrite_all
def park(*args, **kwargs):
    write(*args, **kwargs)  # the pack's first bytes are in its tmp file, not yet fsynced or renamed
    pathlib.Path({ready!r}).write_text(str(os.getpid()))
    while True:  # parked mid-write until killed
        time.sleep(1)
localbytes.pwrite_all = park
with open_test_store({root!r}, chunk_tokens=16) as store:
    store.save("w", token_ids(48, seed=3), session(CASES_BY_ID["mla-f32-nodsa"], (48,), 3))
"""


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_writers_tmp_file_lives_exactly_as_long_as_its_process(tmp_path, namespace) -> None:
    prefix = _unshare_prefix() if namespace != "same" else []
    root = tmp_path / "s"
    with open_test_store(root, chunk_tokens=16) as store:
        store.save("a", token_ids(40), session(MLA, (40,)))
    ready = tmp_path / "ready"
    script = WRITER.format(helpers=str(TESTS / "helpers"), repo=str(TESTS.parent), root=str(root), ready=str(ready))
    writer = subprocess.Popen([*prefix, sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert writer.poll() is None, f"the writer exited with {writer.returncode}"
            assert time.monotonic() < deadline, "the writer never reached its write"
            time.sleep(0.01)
        if namespace != "same":
            assert ready.read_text() in ("1", "2")  # a PID that means some other process here
        tmp = [p for p in (root / "tmp").iterdir() if p.is_file()]
        assert len(tmp) == 1
        with open_test_store(root, chunk_tokens=16) as store:
            report = store.gc(dry_run=False)
            assert report.tmp_files == [] and tmp[0].exists()  # a live writer's file is never reaped
            assert report.skipped or report.orphan_objects == []  # its save gate keeps the sweep off
            os.killpg(writer.pid, signal.SIGKILL)  # no cleanup runs: only the kernel drops its lock
            writer.wait(30)
            deadline = time.monotonic() + 30  # unshare's forked child dies just after unshare itself
            while True:
                report = store.gc(dry_run=False)
                if report.tmp_files or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert len(report.tmp_files) == 1 and not tmp[0].exists()
            assert store.restore("a").length == 40 and store.verify(deep=True) == []
    finally:
        if writer.poll() is None:
            os.killpg(writer.pid, signal.SIGKILL)
            writer.wait(30)
