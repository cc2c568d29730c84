"""A restore reads its pack front to back in a few large reads (issue 11: "restores at memory speed"; cold reads).

The kernel's view, from ``strace`` of a real process: every ``preadv`` on the pack between two markers, with the
thread that made it and its offset. Per chunk the bytes are read in at most ``ceil(chunk bytes / BATCH_BYTES)``
calls, each thread's reads move forward through the pack, and the whole restore makes a handful of calls — where
reading layer after layer made one call per (layer, chunk) and hopped back to the front of the pack for every
layer, which defeats readahead on a cold pack. Skips with its reason where strace is missing or ptrace refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from traced import run_traced

from kvshelf.store.restore.piece_reads import BATCH_BYTES

SCRIPT = """
import os, sys
sys.path[:0] = [{helpers!r}, {repo!r}]
import mlx.core as mx
from kvshelf.latent_legos.kv import KVCache
from store_cases import open_test_store, token_ids
caches = []
for layer in range(8):
    c = KVCache()
    k = mx.random.normal((1, 2, 1024, 64), key=mx.random.key(layer)).astype(mx.float16)
    c.update_and_fetch(k, -k)
    caches.append(c)
mark = lambda: os.getpriority(os.PRIO_PROCESS, 0)
with open_test_store({root!r}, chunk_tokens=256) as store:
    store.save("a", token_ids(1024), caches)
    mark()
    r = store.restore("a")
    mx.eval([a for c in r.caches for a in (c.keys, c.values)])
    mark()
    assert r.length == 1024
    assert all(mx.array_equal(a.keys[..., :1024, :], b.keys[..., :1024, :]) for a, b in zip(r.caches, caches))
"""
CALL = re.compile(r"^(\d+)\s+preadv2?\((\d+),\s*\[.*\],\s*(\d+),\s*(\d+)")  # glibc may issue preadv2


@pytest.mark.host_feature("strace")
def test_a_restore_reads_the_pack_forward_in_few_large_reads(tmp_path):
    tests = Path(__file__).parents[1]
    script = SCRIPT.format(helpers=str(tests / "helpers"), repo=str(tests.parent), root=str(tmp_path / "s"))
    trace = run_traced(tmp_path, script, ("preadv", "preadv2", "getpriority"))
    phase, reads = 0, []
    for line in trace.splitlines():
        if "getpriority(" in line:
            phase += 1
        elif phase == 1 and (m := CALL.match(line)):
            tid, _fd, iovcnt, offset = map(int, m.groups())
            reads.append((tid, iovcnt, offset))
    assert phase >= 2 and reads, trace[-2000:]
    data = [(tid, offset) for tid, iovcnt, offset in reads if iovcnt > 1]  # headers are single-buffer reads
    # 4 chunks of 1 MiB (8 layers x K and V x 256 tokens x 2 heads x 64 x f16): two header reads and
    # ceil(1 MiB / BATCH_BYTES) data reads each (4 at 256 KiB) — layer by layer was 16 data reads per chunk
    per_chunk = -(-(1 << 20) // BATCH_BYTES)
    assert len(data) <= 4 * per_chunk and len(reads) <= 4 * (per_chunk + 2), reads
    by_thread: dict[int, list[int]] = {}
    for tid, offset in data:
        by_thread.setdefault(tid, []).append(offset)
    for offsets in by_thread.values():
        assert offsets == sorted(offsets), offsets  # forward through the pack, never back to an earlier layer
