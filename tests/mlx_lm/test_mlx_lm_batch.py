"""restore_batch of sessions saved from mlx-lm's own caches gives mlx-lm's batched classes, exactly what mlx-lm's
``merge`` of the restored rows builds (every state array bit for bit), and mlx-lm model code continues them: a
batched forward and ``BatchGenerator`` give every row the tokens and logits of its serial run.

Serial vs batched is bit-identical wherever mlx-lm's own batching is: on glm_moe_dsa and gemma3_text mlx-lm's own
merged batch already differs from its serial run in the last bits for padded rows (measured with mlx-lm's caches
alone, no kvshelf involved), so there the batch is checked bit for bit against mlx-lm's own merge path and to
1e-5 against the serial run, with identical tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import cache as lm_cache
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm_models import PROMPT, build, forward, greedy, quantized_cache

from kvshelf import Identity, open_store
from kvshelf.errors import InvalidCacheState

ROWS = ((10, 4), (7, 1), (9, 2))  # (prompt length, decode steps): sessions of 14, 8 and 11 tokens
MODELS = {
    "llama": ("llama", make_prompt_cache), "qwen3": ("qwen3", make_prompt_cache),
    "qwen3_window": ("qwen3", lambda m: make_prompt_cache(m, max_kv_size=32)),
    "deepseek_v3": ("deepseek_v3", make_prompt_cache), "glm_moe_dsa": ("glm_moe_dsa", make_prompt_cache),
    "gemma3_text": ("gemma3_text", make_prompt_cache), "qwen3_next": ("qwen3_next", make_prompt_cache),
    "mamba": ("mamba", make_prompt_cache), "mamba2": ("mamba2", make_prompt_cache),
}
MLX_LM_INEXACT = {"glm_moe_dsa", "gemma3_text"}
BATCHED = {lm_cache.KVCache: lm_cache.BatchKVCache, lm_cache.RotatingKVCache: lm_cache.BatchRotatingKVCache,
           lm_cache.ArraysCache: lm_cache.ArraysCache, lm_cache.CacheList: lm_cache.CacheList}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-lm-batch")
    built = {}
    for name, (model_name, make) in MODELS.items():
        model = build(model_name)
        nexts = []
        with open_store(str(root / "store"), identity=Identity(name)) as store:
            for i, (length, steps) in enumerate(ROWS):
                cache = make(model)
                tokens, _ = greedy(model, PROMPT[:length], cache, steps=steps)
                store.save(f"s{i}", PROMPT[:length] + tokens[:steps], cache)
                nexts.append(tokens[steps])
        built[name] = (model, nexts)
    return str(root / "store"), built


def same_state(a, b) -> None:
    fa, fb = tree_flatten(a.state), tree_flatten(b.state)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (key, x), (_, y) in zip(fa, fb):
        if isinstance(x, mx.array):
            assert isinstance(y, mx.array) and x.dtype == y.dtype and x.shape == y.shape, key
            assert np.array_equal(np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x),
                                  np.array(y.astype(mx.float32) if y.dtype == mx.bfloat16 else y)), key
        else:
            assert x == y, key
    if isinstance(a, lm_cache.CacheList):
        for ca, cb in zip(a.caches, b.caches):
            same_state(ca, cb)


def bits_equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and np.array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


def check_row(name: str, got: mx.array, serial: mx.array, via_merge: mx.array) -> None:
    assert bits_equal(got, via_merge), f"{name}: restore_batch differs from mlx-lm's merge of the restored rows"
    if name in MLX_LM_INEXACT:
        assert np.allclose(np.array(got), np.array(serial), atol=1e-5, rtol=0)
    else:
        assert bits_equal(got, serial), f"{name}: a batched row differs from its serial run"


def batched_run(model, caches, nexts, steps=2):
    """A batched forward of each row's next token, then ``steps`` greedy batched steps: per step (B, vocab)."""
    logits = [forward(model, mx.array([[t] for t in nexts]), caches)]
    for _ in range(steps):
        logits.append(forward(model, mx.argmax(logits[-1], axis=-1)[:, None], caches))
    return logits


def serial_run(model, caches, nxt, steps=2):
    logits = [forward(model, [nxt], caches)]
    for _ in range(steps):
        logits.append(forward(model, [int(mx.argmax(logits[-1], axis=-1).item())], caches))
    return logits


@pytest.mark.parametrize("name", list(MODELS))
def test_restore_batch_is_mlx_lm_merge_and_continues_like_serial_rows(stores, name):
    path, built = stores
    model, nexts = built[name]
    with open_store(path, identity=Identity(name)) as store:
        batch = store.restore_batch(["s0", "s1", "s2"])
        rows = [store.restore(f"s{i}").caches for i in range(3)]
        merged = [type(rows[0][j]).merge([r[j] for r in rows]) for j in range(len(rows[0]))]
        assert batch.lengths == [14, 8, 11]
        for layer, (got, want, row) in enumerate(zip(batch.caches, merged, rows[0])):
            assert type(got) is BATCHED[type(row)] is type(want), layer
            same_state(got, want)
        if name in ("llama", "qwen3", "deepseek_v3", "glm_moe_dsa"):  # every layer read straight into the batch
            assert store.counters["batch_layers_direct"] >= len(batch.caches)
        serials = [serial_run(model, store.restore(f"s{b}").caches, nexts[b]) for b in range(3)]
        via_merge = batched_run(model, merged, nexts)
        got = batched_run(model, batch.caches, nexts)
    for step in range(len(got)):
        for b in range(3):
            check_row(name, got[step][b:b + 1], serials[b][step], via_merge[step][b:b + 1])


@pytest.mark.parametrize("name", list(MODELS))
def test_batch_generator_continues_restored_rows_like_serial_generation(stores, name):
    path, built = stores
    model, nexts = built[name]
    with open_store(path, identity=Identity(name)) as store:
        batch = store.restore_batch(["s0", "s1", "s2"])
        rows = [[layer.extract(b) for layer in batch.caches] for b in range(3)]
        serial = []
        for b in range(3):
            steps = generate_step(mx.array([nexts[b]]), model, max_tokens=3, prompt_cache=store.restore(f"s{b}").caches)
            serial.append([(int(t), lp) for t, lp in steps])
    gen = BatchGenerator(model, max_tokens=3)
    try:
        uids = gen.insert([[t] for t in nexts], caches=rows)
        got = {uid: [] for uid in uids}
        while responses := gen.next_generated():
            for r in responses:
                got[r.uid].append((r.token, r.logprobs))
    finally:
        gen.close()
    for uid, want in zip(uids, serial):
        assert [t for t, _ in got[uid]] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got[uid], want):
            if name in MLX_LM_INEXACT:
                assert np.allclose(np.array(a), np.array(b), atol=1e-5, rtol=0)
            else:
                assert bits_equal(a, b)


def test_kinds_mlx_lm_cannot_batch_are_refused_clearly(tmp_path):
    model = build("llama")
    with open_store(str(tmp_path / "store"), identity=Identity("q")) as store:
        for i, (length, steps) in enumerate(ROWS[:2]):
            cache = quantized_cache(model)
            tokens, _ = greedy(model, PROMPT[:length], cache, steps=steps)
            store.save(f"s{i}", PROMPT[:length] + tokens[:steps], cache)
        with pytest.raises(InvalidCacheState, match="QuantizedKVCache has no batched form"):
            store.restore_batch(["s0", "s1"])
        assert store.restore("s0").length == 14  # nothing else changed


def test_restore_batch_of_prefix_hits_is_the_merge_of_the_cut_rows(stores):
    path, _ = stores
    with open_store(path, identity=Identity("llama")) as store:
        full = store.restore("s0")
        prompt = full.tokens[:9] + [1, 2]
        hit = store.lookup(prompt)
        assert hit is not None and hit.length == 9
        batch = store.restore_batch([hit, "s1"])
        rows = [store.restore_prefix(prompt).caches, store.restore("s1").caches]
        assert batch.lengths == [9, 8]
        for got, *layer in zip(batch.caches, *rows):
            same_state(got, lm_cache.BatchKVCache.merge(layer))
