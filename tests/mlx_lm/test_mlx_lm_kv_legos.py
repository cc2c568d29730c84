"""kvshelf's own key/value legos inside real mlx-lm models: batches of unequal rows, BatchGenerator, and the model
code paths that cannot use a lego (which must refuse, never run without history).

Sessions are saved to a real store, restored as one batch (``restore_batch``) and continued with a batched forward
and with mlx-lm's ``BatchGenerator``: every row's logits are bit-identical to its own serial run. Without the
per-row positions mlx-lm model code reads from ``cache.offset`` the shorter rows rotate their new keys at the batch
width and these comparisons fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import cache as lm_cache
from mlx_lm_models import (
    PROMPT,
    build,
    continue_greedy,
    forward,
    greedy,
    same,
    same_run,
)

from kvshelf import Identity, open_store
from kvshelf.errors import InvalidCacheState, KvShelfError
from kvshelf.latent_legos.kv import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    TurboQuantKVCache,
)
from kvshelf.latent_legos.kv.model_face import NotForModelCode

PROMPTS = [PROMPT, PROMPT[:6], PROMPT[:3] + [9]]  # unequal lengths: 10, 6, 4
STEPS = 4

OURS = {
    "kv": lambda model: [KVCache() for _ in model.layers],
    "qkv8": lambda model: [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers],
    "turbo83": lambda model: [TurboQuantKVCache(8, 3) for _ in model.layers],
}


def saved_sessions(store, model, make):
    """Each prompt prefilled on fresh legos and saved as ``s<i>``; returns (first tokens, serial continuations)."""
    firsts, serial = [], []
    for i, prompt in enumerate(PROMPTS):
        caches = make(model)
        tokens, _ = greedy(model, prompt, caches, steps=0)
        store.save(f"s{i}", prompt, caches)
        firsts.append(tokens[0])
        serial.append(continue_greedy(model, tokens[0], caches, STEPS))
    return firsts, serial


def batched_decode(model, caches, firsts):
    """Greedy decode of every row at once: per row, the tokens and (1, vocab) logits of each step."""
    inputs, tokens, logits = list(firsts), [[] for _ in firsts], [[] for _ in firsts]
    for _ in range(STEPS):
        step = forward(model, mx.array([[t] for t in inputs]), caches)
        inputs = mx.argmax(step, axis=-1).tolist()
        for b, t in enumerate(inputs):
            tokens[b].append(t)
            logits[b].append(step[b : b + 1])
    return list(zip(tokens, logits))


def generate(model, prompts, caches):
    """mlx-lm's BatchGenerator over ``prompts`` with ``caches`` per row: per row, tokens and logprobs."""
    gen = BatchGenerator(model, max_tokens=STEPS)
    uids = gen.insert(prompts, caches=caches)
    tokens, logprobs = {u: [] for u in uids}, {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
    gen.close()
    return [(tokens[u], logprobs[u]) for u in uids]


def log_probs(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize(("name", "kind"), [("llama", "kv"), ("qwen3", "kv"), ("deepseek_v3", "kv"), ("llama", "qkv8"),
                                           ("llama64", "turbo83")])
def test_restore_batch_of_unequal_rows_decodes_each_row_like_its_serial_run(tmp_path, name, kind):
    model = build(name)
    with open_store(tmp_path / "store", identity=Identity(name)) as store:
        firsts, serial = saved_sessions(store, model, OURS[kind])
        batch = store.restore_batch(["s0", "s1", "s2"])
    assert all(type(c) is type(OURS[kind](model)[0]) for c in batch.caches)
    assert batch.caches[0].offset == 10 and batch.caches[0].row_offsets == [10, 6, 4]  # kvshelf's view: the width
    assert batch.caches[0].rope_offset.tolist() == [10, 6, 4]
    for b, (got, want) in enumerate(zip(batched_decode(model, batch.caches, firsts), serial)):
        assert same_run(got, want), f"row {b} of {name}/{kind} differs from its serial run"


@pytest.mark.parametrize(("name", "kind"), [("llama", "kv"), ("deepseek_v3", "kv"), ("qwen3", "qkv8"),
                                           ("llama64", "turbo83")])
def test_batch_generator_accepts_restored_rows_and_matches_serial_runs(tmp_path, name, kind):
    model = build(name)
    with open_store(tmp_path / "store", identity=Identity(name)) as store:
        firsts, serial = saved_sessions(store, model, OURS[kind])
        rows = [store.restore(f"s{i}").caches for i in range(len(PROMPTS))]
    results = generate(model, [[f] for f in firsts], rows)
    for (tokens, logprobs), (want_tokens, want_logits) in zip(results, serial):
        assert tokens == want_tokens
        assert all(same(lp[None], log_probs(w)) for lp, w in zip(logprobs, want_logits))


def test_batch_generator_prefills_unequal_continuations_on_restored_rows(tmp_path):
    """Continuations of different lengths go through mlx-lm's right-padded prefill (prepare/finalize) on our rows."""
    model = build("llama")
    extra = [[7, 1, 33], [12], [5, 61]]
    with open_store(tmp_path / "store", identity=Identity("llama")) as store:
        firsts, _ = saved_sessions(store, model, OURS["kv"])
        rows = [store.restore(f"s{i}").caches for i in range(len(PROMPTS))]
        serial = []
        for i, (first, more) in enumerate(zip(firsts, extra)):
            caches = store.restore(f"s{i}").caches
            forward(model, [first, *more[:-1]], caches)
            serial.append(continue_greedy(model, more[-1], caches, STEPS))
    results = generate(model, [[f, *more] for f, more in zip(firsts, extra)], rows)
    for (tokens, logprobs), (want_tokens, want_logits) in zip(results, serial):
        assert tokens == want_tokens
        assert all(same(lp[None], log_probs(w)) for lp, w in zip(logprobs, want_logits))
    extracted = [c.extract(0) for c in rows[0]]  # BatchGenerator's extract gives kvshelf's class back, serial
    assert all(type(c) is KVCache and c.batch_size == 1 for c in extracted)


def read_offset_as(module: str, cache):
    """``cache.offset`` read by code living in ``module`` (how mlx-lm's model code reads it)."""
    scope = {"__name__": module, "cache": cache}
    exec("offset = cache.offset", scope)  # noqa: S102 - a frame whose module is ``module``, nothing else
    return scope["offset"]


def test_kvshelf_code_sees_the_width_and_mlx_lm_code_sees_per_row_positions():
    rows = []
    for n in (5, 2, 9):
        row = KVCache()
        row.update_and_fetch(mx.zeros((1, 1, n, 8)), mx.zeros((1, 1, n, 8)))
        rows.append(row)
    batched = KVCache().merge(rows)  # mlx-lm's merge name on kvshelf's rows
    assert batched.offset == 9 and batched.row_offsets == [5, 2, 9] and batched.left_padding.tolist() == [4, 7, 0]
    assert read_offset_as("tests.my_model", batched) == 9
    for module in ("mlx_lm.models.llama", "mlx_vlm.models.qwen2_vl"):
        positions = read_offset_as(module, batched)
        assert positions.dtype == mx.int32 and positions.tolist() == [5, 2, 9]
    assert read_offset_as("mlx_lm.models.llama", rows[0]) == 5  # one row: mlx-lm's serial int


def test_mamba_refuses_kvshelf_arrays_cache_instead_of_running_without_history():
    model = build("mamba")
    with pytest.raises(InvalidCacheState, match="mamba stores its state only into mlx_lm"):
        greedy(model, PROMPT, [ArraysCache(2) for _ in model.layers], steps=2)
    # the other direction: mlx-lm's own ArraysCache carries mamba's history (the decode differs from no history)
    with_history = greedy(model, PROMPT, lm_cache.make_prompt_cache(model), steps=2)
    assert not same(with_history[1][1], forward(model, [with_history[0][0]], lm_cache.make_prompt_cache(model)))


@pytest.mark.parametrize("name", ["mamba2", "qwen3_next"])
def test_recurrent_models_that_assign_slots_run_bit_identically_on_kvshelf_arrays_cache(name):
    model = build(name)
    ours = [ArraysCache(c.cache.__len__()) if isinstance(c, lm_cache.ArraysCache) else KVCache()
            for c in lm_cache.make_prompt_cache(model)]
    assert same_run(greedy(model, PROMPT, ours, steps=4), greedy(model, PROMPT, lm_cache.make_prompt_cache(model), 4))
    assert ours[0].offset == len(PROMPT) + 4  # the models advance our bookkeeping


def test_glm_indexer_runs_on_kvshelf_kv_caches_and_refuses_code_caches():
    model = build("glm_moe_dsa")
    ours = [lm_cache.CacheList(KVCache(), KVCache()) for _ in model.layers]
    assert same_run(greedy(model, PROMPT, ours, steps=4), greedy(model, PROMPT, lm_cache.make_prompt_cache(model), 4))
    turbo = TurboQuantKVCache(8, 3)
    with pytest.raises(NotForModelCode, match="holds codes"):
        _ = turbo.keys
    assert isinstance(NotForModelCode("x"), KvShelfError) and not hasattr(turbo, "values")  # hasattr stays a probe
    quant = QuantizedKVCache(group_size=32, bits=8)
    quant.update_and_fetch(mx.zeros((1, 1, 3, 32)), mx.zeros((1, 1, 3, 32)))
    before = [mx.array(a) for a in quant.state]
    with pytest.raises(InvalidCacheState, match="affine triples"):
        quant.values = mx.zeros((1, 1, 256, 32))
    assert all(same(a, b) for a, b in zip(before, quant.state))
    plain = KVCache()
    plain.update_and_fetch(mx.zeros((1, 1, 3, 32)), mx.zeros((1, 1, 3, 32)))
    with pytest.raises(InvalidCacheState, match="must be replaced by"):
        plain.values = mx.zeros((1, 1, 3, 32))  # not the buffer's shape


def test_quantized_and_turbo_legos_do_not_import_the_plain_one():
    """kv/plain imports kv/quantized and kv/turbo for its conversions; they must not import it back (no circle)."""
    here = Path(__file__).parents[2] / "kvshelf" / "latent_legos" / "kv"
    for name in ("quantized.py", "turbo.py", "rotating.py", "token_rows.py", "dtypes.py", "model_face.py"):
        tree = ast.parse((here / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert "plain" not in imported, name


def test_ring_rows_laid_out_differently_refuse_to_batch_instead_of_misaligning(tmp_path):
    """gemma3_text's sliding layers on kvshelf's RotatingKVCache: unequal rows cannot share one ring layout."""
    from kvshelf.latent_legos.kv import RotatingKVCache

    model = build("gemma3_text")

    def ours(m):
        return [RotatingKVCache(c.max_size) if isinstance(c, lm_cache.RotatingKVCache) else KVCache()
                for c in lm_cache.make_prompt_cache(m)]

    assert same_run(greedy(model, PROMPT, ours(model), 4), greedy(model, PROMPT, lm_cache.make_prompt_cache(model), 4))
    with open_store(tmp_path / "store", identity=Identity("gemma")) as store:
        firsts, _ = saved_sessions(store, model, ours)
        with pytest.raises(InvalidCacheState, match="laid out alike"):
            store.restore_batch(["s0", "s1"])
        rows = [store.restore(f"s{i}").caches for i in range(2)]
    with pytest.raises(InvalidCacheState, match="laid out alike"):
        generate(model, [[f] for f in firsts[:2]], rows)


def recurrent_ours(model):
    return [ArraysCache(len(c.cache)) if isinstance(c, lm_cache.ArraysCache) else KVCache()
            for c in lm_cache.make_prompt_cache(model)]


@pytest.mark.parametrize("name", ["qwen3_next", "mamba2"])
def test_recurrent_rows_restore_as_a_batch_and_join_batch_generator(tmp_path, name):
    model = build(name)
    with open_store(tmp_path / "store", identity=Identity(name)) as store:
        firsts, serial = saved_sessions(store, model, recurrent_ours)
        batch = store.restore_batch(["s0", "s1", "s2"])
        assert isinstance(batch.caches[0], ArraysCache) and batch.caches[0].row_offsets == [10, 6, 4]
        for got, want in zip(batched_decode(model, batch.caches, firsts), serial):
            assert same_run(got, want)
        rows = [store.restore(f"s{i}").caches for i in range(len(PROMPTS))]
        extra = [[7, 1, 33], [12], [5, 61]]  # unequal continuations: a right-padded prefill on recurrent state
        want = []
        for i, (first, more) in enumerate(zip(firsts, extra)):
            caches = store.restore(f"s{i}").caches
            forward(model, [first, *more[:-1]], caches)
            want.append(continue_greedy(model, more[-1], caches, STEPS))
    for (tokens, logprobs), (want_tokens, want_logits) in zip(
            generate(model, [[f, *more] for f, more in zip(firsts, extra)], rows), want):
        assert tokens == want_tokens
        assert all(same(lp[None], log_probs(w)) for lp, w in zip(logprobs, want_logits))


def test_right_padded_prompt_step_keeps_each_recurrent_rows_own_length():
    cache = ArraysCache(1)
    cache[0] = mx.zeros((3, 2))
    cache.prepare(lengths=[4, 2, 3], right_padding=[0, 2, 1])  # BatchGenerator's padded prompt step
    assert cache.make_mask(4).tolist() == [[True] * 4, [True, True, False, False], [True, True, True, False]]
    cache.advance(4)  # the model froze rows 1 and 2 at their own ends through that mask
    cache.finalize()
    assert cache.row_offsets == [4, 2, 3] and cache.lengths is None and cache.left_padding is None


@pytest.mark.parametrize("restored_first", [True, False])
def test_batch_generator_mixes_restored_kvshelf_rows_with_fresh_mlx_lm_rows(tmp_path, restored_first):
    """A server resumes some sessions from the store while fresh prompts run on mlx-lm's own caches: whichever batch
    joins the other (mlx-lm's ``BatchKVCache.extend`` or ours), every sequence continues like its serial run."""
    model = build("llama")
    with open_store(tmp_path / "store", identity=Identity("llama")) as store:
        firsts, serial = saved_sessions(store, model, OURS["kv"])
        resumed = store.restore("s1").caches
    fresh_tokens = greedy(model, PROMPT, lm_cache.make_prompt_cache(model), steps=STEPS)[0][:STEPS]
    gen = BatchGenerator(model, max_tokens=STEPS)
    got: dict[int, list] = {}

    def collect(responses):
        for r in responses:
            got.setdefault(r.uid, []).append((r.token, r.logprobs))

    def insert(which):
        return gen.insert([[firsts[1]]], caches=[resumed])[0] if which == "resumed" else gen.insert([PROMPT])[0]

    order = ["resumed", "fresh"] if restored_first else ["fresh", "resumed"]
    uids = {order[0]: insert(order[0])}
    collect(gen.next_generated())  # the first sequence runs before the second joins
    uids[order[1]] = insert(order[1])
    while responses := gen.next_generated():
        collect(responses)
    gen.close()
    assert [t for t, _ in got[uids["fresh"]]] == fresh_tokens
    assert [t for t, _ in got[uids["resumed"]]] == serial[1][0]
    assert all(same(lp[None], log_probs(w)) for (_, lp), w in zip(got[uids["resumed"]], serial[1][1]))
