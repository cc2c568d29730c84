"""RunHash (xxh3-128 through ctypes, GIL released) must give exactly xxhash's digest: it names content-addressed chunks."""

from __future__ import annotations

import sys
import threading
import time

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.store.objects import runhash
from kvshelf.store.objects.runhash import RunHash


@settings(max_examples=200, deadline=None)
@given(prefix=st.binary(max_size=300), data=st.binary(max_size=5000), cuts=st.lists(st.integers(0, 5000), max_size=8))
def test_digest_equals_xxhash_for_any_split(prefix, data, cuts):
    h = RunHash(prefix)
    at = 0
    buf = memoryview(bytearray(data))
    for c in sorted(min(c, len(data)) for c in cuts) + [len(data)]:
        h.update(buf[at:c])
        at = c
    assert h.hexdigest() == xxhash.xxh3_128(prefix + data).hexdigest()


def test_read_only_and_large_buffers():
    big = bytes(range(256)) * 4096 * 3  # 3 MiB: past xxh3's long-input paths
    h = RunHash(b"d")
    h.update(memoryview(big))          # read-only input is copied, still the same digest
    h.update(bytearray(b"tail"))
    assert h.hexdigest() == xxhash.xxh3_128(b"d" + big + b"tail").hexdigest()


def _ticks_during(update, runs) -> int:
    """How often another Python thread ran while ``update`` was fed ``runs``, with the switch interval at 1 s so the
    only chance it gets is the GIL being released by the update itself (it hands the GIL back at once after each
    tick, so the update is never kept waiting)."""
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # hands the GIL straight back: the hashing thread never waits for the switch interval

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        t = threading.Thread(target=count)
        t.start()  # runs until it hands the GIL back (≤ 1 s), then waits for the next release
        before = ticks[0]
        for r in runs:
            update(r)
        during = ticks[0] - before
        stop.set()
        t.join()
    finally:
        sys.setswitchinterval(old)
    return during


def test_small_runs_release_the_gil():
    """The point of the module: 64 KiB runs (a KV piece's head runs) hashed without the GIL. Counted, not timed:
    the plain ``xxhash`` object holds the GIL for inputs this small, so the other thread never runs during it."""
    assert runhash.GIL_FREE, "xxhash's extension no longer exports the XXH3 C API: restores hash serially"
    data = memoryview(bytearray(64 << 20))
    runs = [data[i:i + (64 << 10)] for i in range(0, len(data), 64 << 10)]
    assert _ticks_during(RunHash().update, runs) > 0
    # (xxhash.xxh3_128().update over the same runs gives 0 on xxhash 3.x: it keeps the GIL under ~100 KiB)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=6))
def test_content_hash_is_the_same_through_either_hasher(sizes):
    """``blobfile.content_hash`` picks the xxhash object for chunks of small runs and RunHash for large ones: a
    chunk's name must not depend on that choice."""
    import numpy as np

    from kvshelf.store.objects import chunkfile as blobfile
    from kvshelf.store.objects.chunkfile import Piece

    rng = np.random.default_rng(sum(sizes))
    pieces = [Piece(f"0.{i}.t", "uint8", (n,), memoryview(rng.integers(0, 255, n, dtype=np.uint8)))
              for i, n in enumerate(sizes)]
    saved = blobfile.SMALL_RUNS
    try:
        blobfile.SMALL_RUNS = 0  # never "small": RunHash
        a = blobfile.content_hash(pieces)
        blobfile.SMALL_RUNS = 1 << 40  # always "small": the xxhash object
        b = blobfile.content_hash(pieces)
    finally:
        blobfile.SMALL_RUNS = saved
    assert a == b
