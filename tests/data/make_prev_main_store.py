"""Make the fixture store written by the main before issue 28's restructuring (``tests/data/prev_main_store``) and
its expected contents (``prev_main_store.expected.json``).

Why: issue 28 moved every module of the store (the façade, opening, the rooms' imports, "blob" → "chunk") and promised
that nothing on disk changed. This store was written once by the previous main (11a617e) and committed, so that
``tests/store/test_store_prev_main.py`` opens bytes the old code really wrote, restores them bit-exact and verifies
them clean. To remake it, run this script against that code:

    git archive 11a617e kvshelf | tar -x -C /tmp/kvshelf-prev
    PYTHONPATH=/tmp/kvshelf-prev:tests/helpers python tests/data/make_prev_main_store.py

Sessions: key/value float16 and bfloat16 caches (4-token chunks) — a chat and a grown copy sharing its chunks, one in
another namespace, one with a prefix checkpoint at 24 tokens, a pinned one — and a generation checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "helpers"))

import mlx.core as mx  # noqa: E402

from make_v1_store import kv_cache, state_checksum, tokens  # noqa: E402

from kvshelf import Identity, open_store  # noqa: E402

IDENTITY = Identity("prev-main-fixture-model", config_fingerprint="cfg-prev", tokenizer_hash="tok-prev")
CHUNK_TOKENS = 4
STORE = os.path.join(HERE, "prev_main_store")
EXPECTED = os.path.join(HERE, "prev_main_store.expected.json")


def cache_of(n: int, seed: int, dtype=mx.float16) -> list:
    first = n // 2
    return [kv_cache((first, n - first), seed + layer, dtype) for layer in range(2)]


def main() -> None:
    if os.path.exists(STORE):
        shutil.rmtree(STORE)
    chat = tokens(60, 1)
    plan = [("chat", "", chat, 10, mx.float16),
            ("chat-grown", "", chat + tokens(20, 2), 20, mx.float16),
            ("tenant", "tenant-x", chat[:32] + tokens(9, 5), 50, mx.bfloat16),
            ("pinned", "", tokens(17, 6), 60, mx.bfloat16)]
    expected: dict[str, dict] = {}
    with open_store(STORE, identity=IDENTITY, chunk_tokens=CHUNK_TOKENS) as store:
        for name, ns, toks, seed, dtype in plan:
            caches = cache_of(len(toks), seed, dtype)
            store.save(name, toks, caches, namespace=ns)
            expected[name] = {"namespace": ns, "tokens": toks, "checksums": [state_checksum(c) for c in caches]}
        ckpt = tokens(40, 7)
        store.save("with-checkpoint", ckpt, cache_of(40, 70), checkpoints={24: cache_of(24, 70)})
        expected["with-checkpoint"] = {"namespace": "", "tokens": ckpt,
                                       "checksums": [state_checksum(c) for c in cache_of(40, 70)],
                                       "checkpoint_24": [state_checksum(c) for c in cache_of(24, 70)]}
        store.pin("pinned")
        prompt, gen = tokens(12, 8), tokens(3, 9)
        store.save_generation_checkpoint("gen-key", prompt + gen, cache_of(15, 80), prompt_length=12,
                                         pending_token=5, sampler_state=None)
        generation = {"key": "gen-key", "prompt": prompt, "tokens": prompt + gen, "pending_token": 5,
                      "checksums": [state_checksum(c) for c in cache_of(15, 80)]}
        assert store.verify(deep=True) == []
    for path in (os.path.join(STORE, "index", "lock.mdb"), os.path.join(STORE, "locks", "reserve")):
        if os.path.exists(path):  # per-machine state (the reserve is reallocated at open): not part of the fixture
            os.remove(path)
    with open(EXPECTED, "w") as f:
        json.dump({"identity": [IDENTITY.model_id, IDENTITY.config_fingerprint, IDENTITY.tokenizer_hash],
                   "chunk_tokens": CHUNK_TOKENS, "sessions": expected, "generation": generation}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
