"""What the open-time page walk of ``data.mdb`` costs.

``python -m tests.helpers.lmdb_walk_cost [--sessions N] [--tokens T]``.

Builds a store of N sessions of T tokens (small caches: the index is what is measured; 2,000 x 100 gives a ~20 MiB
index, 2,000 x 700 a ~60 MiB one) in a temporary directory (``/dev/shm`` when writable), then times
``lmdbcheck.check_data_file`` on its index: cold (the walk: the memo removed before each run) and warm (the memo
matches: no walk), best and median of ``--runs``. A figure, not a test: the machine's load moves it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.helpers.lmdb_walk_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--runs", type=int, default=9)
    args = p.parse_args()

    from kvshelf import open_store
    from kvshelf.store.index import lmdb_check as lmdbcheck, lmdb_walk_memo as walkmemo

    from ..soak.cases import CHUNK, IDENTITY, make_caches, tokens_for

    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    work = Path(tempfile.mkdtemp(prefix="kvshelf-walk-", dir=shm))
    try:
        caches = make_caches("kv", args.tokens, 1)
        with open_store(work, identity=IDENTITY, chunk_tokens=CHUNK) as store:
            for i in range(args.sessions):
                store.save(f"session-{i}", tokens_for("kv", i, args.tokens), caches, namespace="" if i % 3 else "b")
        index = work / "index"
        size = (index / "data.mdb").stat().st_size
        cold, warm = [], []
        for _ in range(args.runs):
            (index / walkmemo.NAME).unlink(missing_ok=True)
            t = time.perf_counter()
            lmdbcheck.check_data_file(str(index))
            cold.append(time.perf_counter() - t)
        lmdbcheck.check_data_file(str(index))
        for _ in range(args.runs):
            t = time.perf_counter()
            assert lmdbcheck.check_data_file(str(index)) == 0
            warm.append(time.perf_counter() - t)
        cold.sort()
        warm.sort()
        print(f"{args.sessions} sessions x {args.tokens} tokens: data.mdb {size / 2**20:.1f} MiB; walk (cold) best "
              f"{cold[0] * 1e3:.1f} ms, median {cold[len(cold) // 2] * 1e3:.1f} ms; memo hit (warm) best "
              f"{warm[0] * 1e3:.2f} ms, median {warm[len(warm) // 2] * 1e3:.2f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
