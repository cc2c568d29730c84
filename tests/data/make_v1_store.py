"""Make the layout-v1 fixture store (``tests/data/v1_store``) and its expected contents (``v1_store.expected.json``).

Run once against the v1 code (one file per chunk blob, one manifest file per snapshot) and committed, so that
later layouts prove they still open, list, restore and verify what v1 wrote (``tests/store/test_store_v1_fixture.py``):

    PYTHONPATH=. python tests/data/make_v1_store.py

Sessions: MLA f32; encoded affine-8 and TurboQuant-8 with their f32 shadow; paged affine-4; KV f16 and bf16; a
prefix-sharing pair (the second extends the first, so chunks are shared); one chunk recompressed to zstd with
``rewrite_chunk``. Checksums are xxh3-64 over every state array's dtype, shape and bits.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "helpers"))  # tests/helpers: the case builders

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from codec_cases import CASES_BY_ID, filled  # noqa: E402
from kv_cases import fill  # noqa: E402
from kvshelf import Identity, open_store  # noqa: E402
from kvshelf.latent_legos.kv import KVCache  # noqa: E402

IDENTITY = Identity("v1-fixture-model", config_fingerprint="cfg-v1", tokenizer_hash="tok-v1")
CHUNK_TOKENS = 4
STORE = os.path.join(HERE, "v1_store")
EXPECTED = os.path.join(HERE, "v1_store.expected.json")


def state_checksum(cache) -> str:
    """xxh3-64 over type name, offset and every state array (dtype, shape, bits), in order."""
    h = xxhash.xxh3_64(type(cache).__name__.encode() + str(cache.offset).encode())
    # the bytes a snapshot stores: a cache that holds its planes in another form in memory (TurboQuant k8 codes
    # held pre-flipped for quantized_matmul) says so with ``persisted_state``
    state = getattr(cache, "persisted_state", cache.state)
    flat = []
    for item in state if isinstance(state, (tuple, list)) else [state]:
        flat.extend(item if isinstance(item, (tuple, list)) else [item])
    for a in flat:
        if a is None:
            h.update(b"<none>")
            continue
        mx.eval(a)
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.array(a).tobytes())
    return h.hexdigest()


def kv_cache(steps, seed, dtype):
    cache = KVCache()
    fill(cache, steps, seed=seed, heads=2, dk=16, dv=16, dtype=dtype)
    return cache


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, size=n)]


def sessions() -> dict[str, tuple[list[int], list]]:
    out: dict[str, tuple[list[int], list]] = {}
    for name, case_id, lengths in [("mla-f32", "mla-f32-nodsa", (6, 5)),
                                   ("encoded-affine8", "encoded-affine8-nodsa-unconverted", (5, 4)),
                                   ("encoded-turbo8", "encoded-turbo8-nodsa-unconverted", (7, 3)),
                                   ("paged-affine4", "paged-affine4-nodsa", (6, 4))]:
        case = CASES_BY_ID[case_id]
        caches = [filled(case, lengths=lengths, seed=10 * layer + len(out)) for layer in range(2)]
        out[name] = (tokens(sum(lengths), len(out)), caches)
    for name, dtype in [("kv-f16", mx.float16), ("kv-bf16", mx.bfloat16)]:
        caches = [kv_cache((6, 5), 50 + layer + len(out), dtype) for layer in range(2)]
        out[name] = (tokens(11, len(out)), caches)
    return out


def main() -> None:
    if os.path.exists(STORE):
        shutil.rmtree(STORE)
    expected: dict[str, dict] = {}
    with open_store(STORE, identity=IDENTITY, chunk_tokens=CHUNK_TOKENS) as store:
        for name, (toks, caches) in sessions().items():
            store.save(name, toks, caches)
            expected[name] = {"tokens": toks, "checksums": [state_checksum(c) for c in caches]}
        # the prefix-sharing pair: the second session extends the first one's cache and tokens (shared chunks)
        case = CASES_BY_ID["mla-f32-nodsa"]
        shared = [filled(case, lengths=(8,), seed=70 + layer) for layer in range(2)]
        base = tokens(8, 99)
        store.save("share-a", base, shared)
        expected["share-a"] = {"tokens": base, "checksums": [state_checksum(c) for c in shared]}
        from codec_cases import append

        for layer, cache in enumerate(shared):
            append(cache, 5, 80 + layer)
        grown = base + tokens(5, 98)
        info = store.save("share-b", grown, shared)
        assert info.chunks_reused >= 2, info
        expected["share-b"] = {"tokens": grown, "checksums": [state_checksum(c) for c in shared]}
        victim = store.admin.manifest(info.snapshot_id).chunks[-1].hash
        assert store.admin.rewrite_chunk(victim, "zstd", level=3) is not None
        assert store.verify(deep=True) == []
    with open(EXPECTED, "w") as f:
        json.dump({"identity": [IDENTITY.model_id, IDENTITY.config_fingerprint, IDENTITY.tokenizer_hash],
                   "chunk_tokens": CHUNK_TOKENS, "zstd_chunk": victim, "sessions": expected}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
