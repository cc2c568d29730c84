"""The durability order of a save, proved from the kernel's side (issue 12): kill -9 keeps the page cache, so no
crash test can show that a pack is on disk before the index commit that names it. ``strace -f -y`` records a real
save's file system calls (each fd shown with its path); the test then checks, for every object the committed
manifest references that this save wrote, that

    its last data write  <  its fsync  <  its rename into place  <  the fsync of its directory  <  the index commit

where the index commit is LMDB's first write to ``data.mdb`` in the save (its pages, then its meta page, each
followed by LMDB's own fdatasync). Skips with its reason where strace is missing or ptrace is refused.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from traced import run_traced

TESTS = Path(__file__).parents[1]
CALLS = ("openat", "write", "pwrite64", "pwritev", "pwritev2", "writev", "fsync", "fdatasync", "rename",
         "renameat", "renameat2", "getpriority")

SCRIPT = """
import json, os, sys
sys.path[:0] = [{helpers!r}, {repo!r}]
from store_cases import open_test_store, session, token_ids
from codec_cases import CASES_BY_ID
case = CASES_BY_ID["mla-f32-nodsa"]
mark = lambda: os.getpriority(os.PRIO_PROCESS, 0)
with open_test_store({root!r}, chunk_tokens=16) as store:
    store.save("warm", token_ids(40, seed=9), session(case, (40,), 9))
    caches = session(case, (100,), 0)
    mark()
    info = store.save("a", token_ids(100), caches)
    mark()
    m = store.admin.manifest(info.snapshot_id)
    objects = sorted({{store.admin.chunk_location(r.hash)[0] for r in m.all_chunks}})
    json.dump({{"objects": objects}}, open({out!r}, "w"))
"""

_LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)$")
_FD = re.compile(r"^(\d+)<([^>]*)>")


def _save_window(trace: str) -> list[tuple[str, str, str]]:
    """(call, fd path or '', rest of the arguments) of every traced call between the two markers."""
    calls, phase = [], 0
    for line in trace.splitlines():
        m = _LINE.match(line)
        if m is None or "resumed>" in line:
            continue
        name, args = m.group(2), m.group(3)
        if name == "getpriority":
            phase += 1
            continue
        if phase != 1:
            continue
        fd = _FD.match(args)
        calls.append((name, fd.group(2) if fd else "", args))
    return calls


@pytest.mark.host_feature("strace")
def test_every_object_a_save_commits_is_fsynced_with_its_directory_before_the_commit(tmp_path: Path) -> None:
    root, out = tmp_path / "s", tmp_path / "objects.json"
    trace = run_traced(tmp_path, SCRIPT.format(helpers=str(TESTS / "helpers"), repo=str(TESTS.parent), root=str(root),
                                               out=str(out)), CALLS, flags=("-y", "-s", "256"))
    calls = _save_window(trace)
    objects = json.loads(out.read_text())["objects"]
    data_mdb = str((root / "index" / "data.mdb").resolve())
    commit = next(i for i, (name, path, _a) in enumerate(calls)
                  if path == data_mdb and name in ("write", "pwrite64", "pwritev", "pwritev2", "writev"))
    assert any(name in ("fsync", "fdatasync") and path == data_mdb for name, path, _a in calls[commit:]), \
        "LMDB synced its commit"
    written = []
    for obj in objects:
        final = str((root / obj).resolve())
        renames = [i for i, (name, _p, args) in enumerate(calls) if name.startswith("rename") and final in args]
        if not renames:
            continue  # deduplicated: stored by an earlier save (its own order was checked then)
        written.append(obj)
        rename = renames[0]
        tmp = re.search(r'"([^"]*\.tmp)"', calls[rename][2]).group(1)
        tmp = str(Path(tmp).resolve()) if os.path.isabs(tmp) else tmp
        writes = [i for i, (name, path, _a) in enumerate(calls)
                  if path.endswith(os.path.basename(tmp)) and name in ("write", "pwrite64", "pwritev", "pwritev2",
                                                                        "writev")]
        syncs = [i for i, (name, path, _a) in enumerate(calls)
                 if path.endswith(os.path.basename(tmp)) and name in ("fsync", "fdatasync")]
        dir_syncs = [i for i, (name, path, _a) in enumerate(calls)
                     if path == os.path.dirname(final) and name in ("fsync", "fdatasync")]
        assert writes, f"{obj}: its bytes were written in this save"
        assert syncs and syncs[-1] > writes[-1], f"{obj}: fsynced after its last write"
        assert syncs[-1] < rename, f"{obj}: fsynced before its rename into place"
        after = [i for i in dir_syncs if i > rename]
        assert after and after[0] < commit, f"{obj}: its directory fsynced after the rename, before the commit"
        assert rename < commit
    assert written, (objects, calls[:40])  # the save wrote its own pack: the check above ran
