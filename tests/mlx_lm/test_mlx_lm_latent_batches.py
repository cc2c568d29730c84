"""Batches of kvshelf's latent adapters in mlx-lm's MLA models: ``restore_batch`` of sessions of unequal lengths and
mlx-lm's ``BatchGenerator`` on restored rows, on the tiny deepseek_v3 and glm_moe_dsa models.

deepseek_v3 rows decode bit-identically to their serial runs. glm_moe_dsa's batched sparse gather orders its top-k
positions by batch column, so there the reference is mlx-lm's own batching of the same rows, which ours equals.
"""

from __future__ import annotations

import pytest
from mlx_lm.models import cache as lm_cache
from mlx_lm_latent_cases import (
    PROMPTS,
    batched_decode,
    generated,
    log_probs,
    provider,
    sessions,
)
from mlx_lm_models import MLA_NAMES, build, forward, greedy, same

from kvshelf import Identity, open_store
from kvshelf.latent_legos import KvScheme
from kvshelf.latent_legos.latent.paged import PagedLatentCache
from kvshelf.mlx_lm import make_prompt_cache
from kvshelf.mlx_lm.latent.cache import DSALatentCache, MLALatentCache


@pytest.mark.parametrize("scheme", [None, KvScheme.affine(8, 32), KvScheme.turbo(8, 3, quantized_kv_start=7)],
                         ids=["f32", "affine8", "turbo8@7"])  # @7: the 10-token row is converted, the others read f32
def test_restore_batch_of_deepseek_latents_decodes_each_row_like_its_serial_run(tmp_path, scheme):
    model = build("deepseek_v3")
    with open_store(tmp_path / "store", identity=Identity("deepseek_v3"), provider=provider()) as store:
        firsts, serial = sessions(store, model, lambda m: make_prompt_cache(m, scheme), PROMPTS)
        batch = store.restore_batch(["s0", "s1", "s2"])
        assert all(type(c) is MLALatentCache and c.lego.row_offsets == [10, 6, 4] for c in batch.caches)
        for b, logits in enumerate(batched_decode(model, batch.caches, firsts)):
            assert all(same(x, y) for x, y in zip(logits, serial[b][1][1])), f"row {b}"
        rows = [store.restore(f"s{i}").caches for i in range(3)]
    for (tokens, logprobs), (_, (want_tokens, logits)) in zip(generated(model, [[f] for f in firsts], rows), serial):
        assert tokens == want_tokens
        assert all(same(lp[None], log_probs(w)) for lp, w in zip(logprobs, logits))


def test_restore_batch_of_glm_latents_equals_mlx_lm_batching_the_same_rows(tmp_path):
    """glm_moe_dsa's batched sparse gather orders the top-k positions by batch column, so a batched row is not
    bit-identical to its serial run even on mlx-lm's own BatchKVCache; our batch must equal that batch exactly."""
    model = build("glm_moe_dsa")
    with open_store(tmp_path / "store", identity=Identity("glm"), provider=provider()) as store:
        firsts, _ = sessions(store, model, make_prompt_cache, PROMPTS)
        batch = store.restore_batch(["s0", "s1", "s2"])
    assert all(type(c) is DSALatentCache for c in batch.caches)
    theirs = []
    for prompt in PROMPTS:
        caches = lm_cache.make_prompt_cache(model)
        greedy(model, prompt, caches, steps=0)
        theirs.append(caches)
    merged = [lm_cache.CacheList.merge([c[i] for c in theirs]) for i in range(len(model.layers))]
    for ours, ref in zip(batched_decode(model, batch.caches, firsts), batched_decode(model, merged, firsts)):
        assert all(same(x, y) for x, y in zip(ours, ref))


def test_paged_latents_batch_and_join_batch_generator(tmp_path):
    model = build("deepseek_v3")
    with open_store(tmp_path / "store", identity=Identity("paged"), provider=provider()) as store:
        firsts, serial = sessions(store, model, lambda m: make_prompt_cache(m, paged_block_size=4), PROMPTS)
        batch = store.restore_batch(["s0", "s1", "s2"])
        assert all(type(c.lego) is PagedLatentCache for c in batch.caches)
        for b, logits in enumerate(batched_decode(model, batch.caches, firsts)):
            assert all(same(x, y) for x, y in zip(logits, serial[b][1][1])), f"row {b}"
        rows = [store.restore(f"s{i}").caches for i in range(3)]
    got = generated(model, [[f] for f in firsts], rows)
    assert [tokens for tokens, _ in got] == [tokens for _, (tokens, _) in serial]


@pytest.mark.parametrize("paged", [None, 4])
def test_batch_generator_prefills_unequal_continuations_on_latent_rows(tmp_path, paged):
    """Restored latent rows take continuations of different lengths (mlx-lm's right-padded prompt step through
    prepare/finalize, a DSA layer's two calls per step inside it) exactly as mlx-lm's own BatchGenerator does on
    mlx-lm's caches (f32). (A one-token continuation runs the MLA layer's multi-token branch in the padded step and
    its one-token branch when alone, so the serial run is not the reference here; mlx-lm's batching is.)"""
    extra = [[7, 1, 33], [12], [5, 61]]
    for name in MLA_NAMES:
        model = build(name)
        with open_store(tmp_path / name, identity=Identity(name), provider=provider()) as store:
            firsts, _ = sessions(store, model, lambda m: make_prompt_cache(m, paged_block_size=paged), PROMPTS)
            rows = [store.restore(f"s{i}").caches for i in range(3)]
        prompts = [[f, *more] for f, more in zip(firsts, extra)]
        ours = generated(model, prompts, rows)
        theirs = []
        for row_prompt in PROMPTS:
            caches = lm_cache.make_prompt_cache(model)
            forward(model, row_prompt, caches)
            theirs.append(caches)
        want = generated(model, prompts, theirs)
        for (tokens, logprobs), (want_tokens, want_lp) in zip(ours, want):
            assert tokens == want_tokens, name
            assert all(same(a, b) for a, b in zip(logprobs, want_lp)), name
