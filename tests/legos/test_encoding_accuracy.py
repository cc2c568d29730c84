"""What latent storage formats cost a model, measured on the synthetic GLM-style MLA stack, and the model's own
row/position handling on every latent cache (prefill, decode, batched right-justified rows).

The KL table is printed with the test output (pytest's capture is lifted for it).
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from kvshelf.errors import InvalidCacheState
from kvshelf.latent_legos.contracts import PrefillPadding
from kvshelf.latent_legos.formats import AffineFormat, TurboFormat, format_key
from kvshelf.latent_legos.latent.mla import MLACache
from kvshelf.latent_legos.latent.paged import PagedLatentCache
from kvshelf.testing.synthetic_model import SyntheticMLAModel

PROMPT, DECODE = 64, 16
FORMATS = {
    "affine 8/64": AffineFormat(8, 64),
    "affine 4/64": AffineFormat(4, 64),
    "turbo k8": TurboFormat(8, 3),
    "turbo k4": TurboFormat(4, 3),
    "turbo k3": TurboFormat(3, 3),
}


@pytest.fixture(scope="module")
def model() -> SyntheticMLAModel:
    return SyntheticMLAModel(num_layers=2, vocab=256, hidden=256, num_heads=4, kv_lora_rank=128,
                             rope_head_dim=64, index_head_dim=64, seed=0)


@pytest.fixture(scope="module")
def tokens() -> mx.array:
    return mx.random.randint(0, 256, (1, PROMPT + DECODE), key=mx.random.key(1)).astype(mx.int32)


def run(model, caches, tokens, prompt=PROMPT):
    """Prefill ``prompt`` tokens, then decode the rest one token per call; logits of every position."""
    outs = [model(tokens[:, :prompt], caches)]
    for i in range(prompt, tokens.shape[1]):
        outs.append(model(tokens[:, i : i + 1], caches))
    logits = mx.concatenate(outs, axis=1)
    mx.eval(logits)
    return logits


def log_probs(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def mean_kl(reference, other, positions=slice(None)):
    """Mean over positions of KL(p_reference || p_other)."""
    lp, lq = log_probs(reference[:, positions]), log_probs(other[:, positions])
    return mx.mean(mx.sum(mx.exp(lp) * (lp - lq), axis=-1)).item()


def encoded_caches(model, fmt):
    from kvshelf.latent_legos.latent.encoded import EncodedLatentCache

    return [EncodedLatentCache(model.geometry, fmt, 0) for _ in range(model.num_layers)]


def paged_caches(model, fmt, block_size=16):
    return [PagedLatentCache(model.geometry, fmt, block_size) for _ in range(model.num_layers)]


def test_logits_kl_table(model, tokens, capsys):
    reference = run(model, model.make_caches(), tokens)
    rows = []
    for name, fmt in FORMATS.items():
        paged = run(model, paged_caches(model, fmt), tokens)
        encoded = run(model, encoded_caches(model, fmt), tokens)
        rows.append((name, mean_kl(reference, paged), mean_kl(reference, encoded, slice(PROMPT, None)),
                     mean_kl(reference, encoded, slice(0, PROMPT))))
    with capsys.disabled():
        print(f"\nlogits KL vs f32 MLACache ({PROMPT}-token prompt + {DECODE} decode steps, 2 layers, DSA)")
        print(f"{'format':<12} {'paged (all pos.)':>17} {'encoded (decode)':>17} {'encoded (prefill)':>18}")
        for name, paged_kl, decode_kl, prefill_kl in rows:
            print(f"{name:<12} {paged_kl:>17.3e} {decode_kl:>17.3e} {prefill_kl:>18.3e}")
    kl = {name: (paged_kl, decode_kl) for name, paged_kl, decode_kl, _ in rows}
    for name, paged_kl, decode_kl, prefill_kl in rows:
        assert math.isfinite(paged_kl) and math.isfinite(decode_kl)
        assert paged_kl >= 0 and decode_kl >= 0
        # f32 first: the prefill append reads f32, so the prompt's logits are exactly the reference's
        assert prefill_kl == 0.0, name
    for column in (0, 1):
        assert kl["affine 8/64"][column] < 1e-3 and kl["turbo k8"][column] < 1e-3
        assert 0 < kl["affine 8/64"][column] < kl["affine 4/64"][column]
        assert 0 < kl["turbo k8"][column] < kl["turbo k4"][column] < kl["turbo k3"][column]
        assert kl["turbo k3"][column] < 1.0


def test_raw_paged_reads_are_bit_equal_to_mla(model, tokens):
    reference = run(model, model.make_caches(), tokens)
    assert mx.array_equal(run(model, paged_caches(model, None), tokens), reference).item()
    assert mean_kl(reference, reference) == 0.0


CACHE_KINDS = {
    "mla": lambda m: m.make_caches(),
    "paged-f32": lambda m: paged_caches(m, None),
    "paged-turbo4": lambda m: paged_caches(m, TurboFormat(4, 3)),
    "encoded-affine4": lambda m: encoded_caches(m, AffineFormat(4, 64)),
}


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_continuation_is_bit_exact_on_the_same_cache_type(model, tokens, kind):
    make = CACHE_KINDS[kind]
    whole = run(model, make(model), tokens)
    assert mx.array_equal(run(model, make(model), tokens), whole).item()  # deterministic
    # stop after 8 decode steps, trim 4 positions off, replay them and continue: same logits, bit for bit
    caches = make(model)
    first = run(model, caches, tokens[:, : PROMPT + 8])
    assert mx.array_equal(first, whole[:, : PROMPT + 8]).item()
    for cache in caches:
        assert cache.trim(4) == 4
        assert cache.offset == PROMPT + 4
    rest = [model(tokens[:, i : i + 1], caches) for i in range(PROMPT + 4, PROMPT + DECODE)]
    assert mx.array_equal(mx.concatenate(rest, axis=1), whole[:, PROMPT + 4 :]).item()


@pytest.mark.parametrize("kind", ["mla", "paged-turbo4"])
def test_extracted_row_continues_like_the_original(model, tokens, kind):
    make = CACHE_KINDS[kind]
    whole = run(model, make(model), tokens)
    caches = make(model)
    model(tokens[:, :PROMPT], caches)
    extracted = [cache.extract_row(0) for cache in caches]
    rest = [model(tokens[:, i : i + 1], extracted) for i in range(PROMPT, PROMPT + DECODE)]
    assert mx.array_equal(mx.concatenate(rest, axis=1), whole[:, PROMPT:]).item()


def _serial(model, make, prompt, steps):
    caches = make(model)
    outs = [model(prompt, caches)] + [model(steps[:, i : i + 1], caches) for i in range(steps.shape[1])]
    return mx.concatenate(outs, axis=1)


@pytest.mark.parametrize("kind", ["mla", "paged-f32", "paged-turbo4"])
def test_batched_rows_match_serial_rows(model, kind):
    make = CACHE_KINDS[kind]
    short = mx.random.randint(0, 256, (1, 40), key=mx.random.key(2)).astype(mx.int32)
    long = mx.random.randint(0, 256, (1, 64), key=mx.random.key(3)).astype(mx.int32)
    steps = mx.random.randint(0, 256, (2, 4), key=mx.random.key(4)).astype(mx.int32)
    want_short = _serial(model, make, short, steps[:1])
    want_long = _serial(model, make, long, steps[1:])
    pad = mx.full((1, 24), 7, dtype=mx.int32)  # any token: padding columns must not reach a real row

    def close(got, want):
        assert got.shape == want.shape
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()

    # left-padded prefill: rows right-justified from the start
    caches = make(model)
    for cache in caches:
        cache.prepare_prefill(PrefillPadding([64, 64], left_padding=[24, 0]))
    prefill = model(mx.concatenate([mx.concatenate([pad, short], axis=1), long]), caches)
    for cache in caches:
        cache.finalize_prefill()
        assert cache.left_pad == [24, 0] and cache.row_offsets == [40, 64]
    decode = mx.concatenate([model(steps[:, i : i + 1], caches) for i in range(4)], axis=1)
    close(prefill[0:1, 24:], want_short[:, :40])
    close(prefill[1:2], want_long[:, :64])
    close(decode[0:1], want_short[:, 40:])
    close(decode[1:2], want_long[:, 64:])

    # right-padded prefill: trailing padding becomes leading padding at finalize
    caches = make(model)
    for cache in caches:
        cache.prepare_prefill(PrefillPadding([40, 64], right_padding=[24, 0]))
    prefill = model(mx.concatenate([mx.concatenate([short, pad], axis=1), long]), caches)
    for cache in caches:
        cache.finalize_prefill()
        assert cache.row_offsets == [40, 64]
    decode = mx.concatenate([model(steps[:, i : i + 1], caches) for i in range(4)], axis=1)
    close(prefill[0:1, :40], want_short[:, :40])
    close(decode[0:1], want_short[:, 40:])
    close(decode[1:2], want_long[:, 64:])

    # rows joining: serial caches merged into one batch
    short_caches, long_caches = make(model), make(model)
    model(short, short_caches)
    model(long, long_caches)
    merged = []
    for a, b in zip(short_caches, long_caches):
        batch = a.make_empty_batch()
        batch.merge_rows([a, b])
        merged.append(batch)
    decode = mx.concatenate([model(steps[:, i : i + 1], merged) for i in range(4)], axis=1)
    close(decode[0:1], want_short[:, 40:])
    close(decode[1:2], want_long[:, 64:])


def test_model_is_seeded_and_validates_inputs(model, tokens):
    again = SyntheticMLAModel(index_head_dim=64, seed=0)
    other = SyntheticMLAModel(index_head_dim=64, seed=1)
    prompt = tokens[:, :8]
    logits = model(prompt, model.make_caches())
    assert logits.dtype == mx.float32 and logits.shape == (1, 8, 256)
    assert mx.array_equal(again(prompt, again.make_caches()), logits).item()
    assert not mx.allclose(other(prompt, other.make_caches()), logits).item()
    # the DSA index keys reach the attention: the same weights without them give other logits
    plain = SyntheticMLAModel(index_head_dim=None, seed=0)
    assert not mx.allclose(plain(prompt, plain.make_caches()), logits).item()
    caches = model.make_caches()
    model(prompt, caches)
    assert caches[0].stored_index_keys().shape == (1, 8, 64)
    with pytest.raises(InvalidCacheState, match="expected 2 caches"):
        model(prompt, caches[:1])
    with pytest.raises(InvalidCacheState, match=r"\[B, L\]"):
        model(prompt[0], caches)
    with pytest.raises(InvalidCacheState, match="rows"):
        model(mx.concatenate([prompt, prompt]), caches)


def test_make_caches_follows_the_scheme(model):
    from kvshelf.latent_legos.latent.scheme import KvScheme

    assert all(isinstance(c, MLACache) for c in model.make_caches())
    turbo = model.make_caches(KvScheme.turbo(4, 3))
    assert [format_key(c.format) for c in turbo] == ["turbo:4:3"] * 2
    paged = model.make_caches(KvScheme.affine(8, 64), paged_block_size=32)
    assert all(isinstance(c, PagedLatentCache) and c.block_size == 32 for c in paged)
