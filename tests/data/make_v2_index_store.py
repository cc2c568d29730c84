"""Make the index-format-2 fixture store (``tests/data/v2_index_store``) and its expected contents
(``v2_index_store.expected.json``).

Format 2 tagged every prefix record with the snapshot id; format 3 tags it with the session's lineage id and adds the
``heads`` table (``kvshelf/store/records.py``). This store was written once by the format-2 code (main at df402d8,
before the change) and committed, so that the migration at open is tested against bytes the old code really wrote,
not against a simulation of them (``tests/store/test_store_prefix_migration.py``). To remake it, run this script against
that code, e.g.:

    git archive df402d8 kvshelf | tar -x -C /tmp/kvshelf-v2
    PYTHONPATH=/tmp/kvshelf-v2:tests/helpers python tests/data/make_v2_index_store.py

Sessions (key/value f16 caches, 4-token chunks): a 70-token chat and a grown copy of it (shared prefix and chunks), a
5-token session (short boundaries only), an exactly-32-token one (boundaries at block multiples, padded ends), one in
another namespace sharing the chat's first 40 tokens, one saved twice with different tokens (a replaced snapshot),
and one saved then deleted (its records gone).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "helpers"))  # tests/helpers: the case builders

import lmdb  # noqa: E402
import mlx.core as mx  # noqa: E402

from make_v1_store import kv_cache, state_checksum, tokens  # noqa: E402

from kvshelf import Identity, open_store  # noqa: E402

IDENTITY = Identity("v2-index-fixture-model", config_fingerprint="cfg-v2", tokenizer_hash="tok-v2")
CHUNK_TOKENS = 4
STORE = os.path.join(HERE, "v2_index_store")
EXPECTED = os.path.join(HERE, "v2_index_store.expected.json")


def cache_of(n: int, seed: int) -> list:
    first = n // 2
    return [kv_cache((first, n - first), seed + layer, mx.float16) for layer in range(2)]


def main() -> None:
    if os.path.exists(STORE):
        shutil.rmtree(STORE)
    chat = tokens(70, 1)
    plan = [("chat", "", chat, 10),
            ("chat-grown", "", chat + tokens(30, 2), 20),
            ("short", "", tokens(5, 3), 30),
            ("block", "", tokens(32, 4), 40),
            ("tenant", "tenant-x", chat[:40] + tokens(9, 5), 50),
            ("replaced", "", tokens(50, 6), 60),
            ("replaced", "", tokens(20, 6) + tokens(40, 7), 70),
            ("deleted", "", tokens(36, 8), 80)]
    expected: dict[str, dict] = {}
    with open_store(STORE, identity=IDENTITY, chunk_tokens=CHUNK_TOKENS) as store:
        for name, ns, toks, seed in plan:
            caches = cache_of(len(toks), seed)
            store.save(name, toks, caches, namespace=ns)
            expected[name] = {"namespace": ns, "tokens": toks, "checksums": [state_checksum(c) for c in caches]}
        store.delete("deleted")
        del expected["deleted"]
        assert store.verify(deep=True) == []
    env = lmdb.open(os.path.join(STORE, "index"), readonly=True, lock=False, max_dbs=16)
    with env.begin() as txn:
        fmt = struct.unpack("<Q", txn.get(b"format", db=env.open_db(b"meta", txn=txn)))[0]
        records = txn.stat(env.open_db(b"prefix", txn=txn, dupsort=True))["entries"]
    env.close()
    assert fmt == 2, f"run this against the format-2 code (found format {fmt})"
    for path in (os.path.join(STORE, "index", "lock.mdb"), os.path.join(STORE, "locks", "reserve")):
        if os.path.exists(path):  # per-machine state (the reserve is reallocated at open): not part of the fixture
            os.remove(path)
    with open(EXPECTED, "w") as f:
        json.dump({"identity": [IDENTITY.model_id, IDENTITY.config_fingerprint, IDENTITY.tokenizer_hash],
                   "chunk_tokens": CHUNK_TOKENS, "format": fmt, "prefix_records": records, "sessions": expected},
                  f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
