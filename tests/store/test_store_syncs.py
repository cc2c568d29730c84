"""How many syncs a durable save and a restore cost (issue 11: at most three per save, none per restore).

Two views of the same fact: the store's recording seam (``kvshelf.store.base.syncs``: every fsync of ours and every LMDB
write transaction, which fsyncs inside its commit), and the kernel's — ``strace`` of a real process counting the
fsync-family system calls between markers (``getpriority``, a call nothing else in the process makes). The strace
test skips with its reason where strace is missing or ptrace is refused (``.ci/run`` installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from codec_cases import CASES_BY_ID
from kv_cases import fill
from store_cases import open_test_store, session, token_ids
from traced import run_traced

from kvshelf.latent_legos.kv import KVCache
from kvshelf.store.base import syncs

MLA = CASES_BY_ID["mla-f32-nodsa"]
SYNC_CALLS = ("fsync", "fdatasync", "sync", "syncfs", "msync", "sync_file_range")


def kv_caches(n: int, seed: int = 0) -> list:
    out = []
    for layer in range(2):
        cache = KVCache()
        fill(cache, (n,), seed=seed + layer, heads=2, dk=16, dv=16)
        out.append(cache)
    return out


@pytest.mark.parametrize("kind", ["mla", "kv"])
def test_a_durable_save_costs_three_syncs_and_a_restore_none(tmp_path, kind):
    make = (lambda n, s=0: session(MLA, (n,), s)) if kind == "mla" else kv_caches
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        store.save("warm", token_ids(40, seed=9), make(40, 9))  # creates the directories once
        with syncs.counting() as save:
            store.save("a", token_ids(100), make(100))  # 7 chunks: v1 paid 2 syncs per chunk and manifest
        assert save == {"fsync": 1, "fsync_dir": 1, "index_commit": 1}
        with syncs.counting() as grown:
            store.save("a", token_ids(100) + token_ids(40, seed=1), make(140))  # replaces, reuses chunks
        assert syncs.total(grown) <= 3
        with syncs.counting() as restore:
            r = store.restore("a")
            p = store.restore_prefix(token_ids(100)[:50] + [1])
            b = store.restore_batch(["a", "warm"])
        assert restore == {} and r.length == 140 and p.length == 50 and len(b.lengths) == 2
        with syncs.counting() as lookups:
            assert store.lookup(token_ids(100)[:20] + [1]).length == 20
            store.sessions()
        assert lookups == {}


SCRIPT = """
import os, sys
sys.path[:0] = [{helpers!r}, {repo!r}]
from store_cases import open_test_store, session, token_ids
from codec_cases import CASES_BY_ID
case = CASES_BY_ID["mla-f32-nodsa"]
mark = lambda: os.getpriority(os.PRIO_PROCESS, 0)
with open_test_store({root!r}, chunk_tokens=16) as store:
    store.save("warm", token_ids(40, seed=9), session(case, (40,), 9))
    caches = session(case, (100,), 0)
    mark()
    store.save("a", token_ids(100), caches)
    mark()
    r = store.restore("a")
    p = store.restore_prefix(token_ids(100)[:50] + [1])
    mark()
    assert r.length == 100 and p.length == 50
    store.save("big", token_ids(12000, seed=3), session(case, (12000,), 3))  # 9 MiB: writeback started early
    mark()
"""


@pytest.mark.host_feature("strace")
def test_the_kernel_sees_at_most_three_syncs_per_save_and_none_per_restore(tmp_path):
    tests = Path(__file__).parents[1]
    script = SCRIPT.format(helpers=str(tests / "helpers"), repo=str(tests.parent), root=str(tmp_path / "s"))
    trace = run_traced(tmp_path, script, (*SYNC_CALLS, "getpriority"))
    phases: list[list[str]] = [[]]
    hints: list[list[str]] = [[]]  # sync_file_range(..., SYNC_FILE_RANGE_WRITE): starts writeback, waits for nothing
    for line in trace.splitlines():
        call = line.split(None, 1)[1] if " " in line else line
        name = call.split("(", 1)[0]
        if call.startswith("getpriority("):
            phases.append([])
            hints.append([])
        elif name == "sync_file_range" and call.split(")", 1)[0].endswith(", SYNC_FILE_RANGE_WRITE"):
            hints[-1].append(call)
        elif name in SYNC_CALLS:  # a sync_file_range with a WAIT flag is a sync like the others
            phases[-1].append(name)
    assert len(phases) >= 5, trace[-2000:]
    save, restore, big = phases[1], phases[2], phases[3]
    assert 1 <= len(save) <= 3, save  # the pack, its directory, the LMDB commit
    assert restore == [] and hints[2] == [], (restore, hints[2])
    assert 1 <= len(big) <= 3, big
    assert len(hints[3]) >= 1, hints[3]  # the 9 MiB pack's writeback was started before its fsync
