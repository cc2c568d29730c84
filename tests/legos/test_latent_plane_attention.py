"""Attention on the encoded latent planes (``store_latent`` / ``attend`` / ``LatentReads``, the mlx-lm faces'
``LatentKeys``): bit for bit a ``mx.quantized_matmul`` reference on the same planes, within a stated tolerance of
decode-then-attend, padding never attended through trims, rollbacks, merges and filters, tiny mlx-lm models
decoding the same greedy tokens, and a decode step that allocates less than one decoded plane.

Tolerances against decode-then-attend: affine planes decode to the values ``quantized_matmul`` uses, so only the
summation order differs (``AFFINE_TOL``, relative to the output's largest magnitude); TurboQuant's decode rounds
every value to bfloat16 first and the product on the planes does not, so the two differ by about one bfloat16
ulp of the values (``TURBO_TOL``).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm_models import MLA_NAMES, PROMPT, build, greedy

from kvshelf.latent_legos import KvScheme
from kvshelf.latent_legos.contracts import LatentAttentionState
from kvshelf.latent_legos.latent.encoded import EncodedLatentCache
from kvshelf.latent_legos.formats import AffineFormat, TurboFormat
from kvshelf.latent_legos.latent.geometry import LatentGeometry
from kvshelf.latent_legos.latent.paged import PagedLatentCache
from kvshelf.latent_legos.latent.plane_attention import attend_decoded, attend_gathered
from kvshelf.mlx_lm import make_prompt_cache
from kvshelf.mlx_lm.latent.attention import LatentKeys
from kvshelf.mlx_lm.latent.dsa import DSALatentCache
from kvshelf.mlx_lm.latent.faces import LatentLayer

AFFINE_TOL, TURBO_TOL = 1e-5, 2e-2
FORMATS = {
    "affine8/64": AffineFormat(8, 64), "affine4/32": AffineFormat(4, 32),
    "turbo-k8": TurboFormat(8, 3), "turbo-k4": TurboFormat(4, 3), "turbo-k3": TurboFormat(3, 3),
}
GEOMETRY = LatentGeometry(128, 64)
HEADS = 4


def _normal(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def _reference_family(fmt, planes):
    """The planes of one family in mlx's affine layout, derived here from the stored planes by the encoding's
    definition (affine: as stored; TurboQuant: ``(idx + zero) * scale``, 8-bit codes shifted to unsigned)."""
    if isinstance(fmt, AffineFormat):
        return (*planes, fmt.bits, fmt.group_size)
    codes, scales, zeros = planes
    s = scales.astype(mx.float32)
    if fmt.k_bits == 8:
        unsigned = (codes.astype(mx.int32) + 128).astype(mx.uint8)
        return unsigned.view(mx.uint32), s, s * (zeros.astype(mx.float32) - 128.0), 8, 32
    return codes.view(mx.uint32), s, s * zeros.astype(mx.float32), fmt.k_bits, 32


def _qmm(x, family, transpose):
    w, s, b, bits, group = family
    return mx.quantized_matmul(x, w[:, None], s[:, None], b[:, None], transpose=transpose, group_size=group, bits=bits)


def reference_row(fmt, planes, q, qr, scale, mask=None):
    """One row's absorbed attention written out with ``mx.quantized_matmul`` on its stored planes."""
    _, H, L, r = q.shape
    latent, rope = (_reference_family(fmt, group) for group in planes[:2])
    T = planes[0][0].shape[1]
    scores = _qmm((q * scale).reshape(1, 1, H * L, r), latent, True)
    scores = scores + _qmm((qr * scale).reshape(1, 1, H * L, qr.shape[-1]), rope, True)
    scores = scores.reshape(1, H, L, T)
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return _qmm(weights.reshape(1, 1, H * L, T), latent, False).reshape(1, H, L, r)


def _tolerance(fmt):
    return AFFINE_TOL if isinstance(fmt, AffineFormat) else TURBO_TOL


def _queries(batch, length, seed):
    return _normal((batch, HEADS, length, GEOMETRY.kv_lora_rank), seed), _normal((batch, HEADS, length, 64), seed + 1)


def _check_rows(cache: EncodedLatentCache, out, q, qr, scale):
    """Every row of ``out`` equals the reference on that row's own planes (bit for bit: its padding columns never
    enter) and is within tolerance of decode-then-attend over the row alone."""
    for b in range(cache.batch_size):
        row = cache.row_state(b)
        ref = reference_row(cache.format, row.planes, q[b : b + 1], qr[b : b + 1], scale)
        assert mx.array_equal(out[b : b + 1], ref).item(), b
        alone = cache.extract_row(b).read_latent()
        decoded = attend_decoded(alone, q[b : b + 1], scale, qr[b : b + 1])
        bound = _tolerance(cache.format) * max(1.0, mx.abs(decoded).max().item())
        assert mx.abs(out[b : b + 1] - decoded).max().item() <= bound, b


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_decode_step_on_the_planes_is_the_quantized_matmul_reference_and_close_to_decode_then_attend(name):
    fmt = FORMATS[name]
    cache = EncodedLatentCache(GEOMETRY, fmt)
    cache.append_latent(_normal((1, 300, 128), 1), _normal((1, 300, 64), 2))
    reads = cache.store_latent(_normal((1, 1, 128), 3), _normal((1, 1, 64), 4))
    assert reads.on_planes
    q, qr = _queries(1, 1, 5)
    out = reads.attend(q, qr, 0.07)
    _check_rows(cache, out, q, qr, 0.07)
    assert mx.array_equal(out, cache.attend(q, qr, 0.07)).item()


@pytest.mark.parametrize("name", ["affine8/64", "turbo-k8", "turbo-k4"])
def test_paged_caches_attend_on_gathered_pages_of_codes(name):
    fmt = FORMATS[name]
    paged, flat = PagedLatentCache(GEOMETRY, fmt, block_size=16), EncodedLatentCache(GEOMETRY, fmt)
    rows = [(_normal((1, n, 128), n), _normal((1, n, 64), n + 1)) for n in (37, 5, 20)]
    for cache in (paged, flat):
        singles = []
        for latent, rope in rows:
            single = cache.make_empty_batch()
            single.append_latent(latent, rope)
            singles.append(single)
        cache.merge_rows(singles)
        cache.trim(2)
    q, qr = _queries(3, 1, 9)
    step = (_normal((3, 1, 128), 11), _normal((3, 1, 64), 12))
    got = paged.store_latent(*step)
    assert got.on_planes
    flat.store_latent(*step)
    out = got.attend(q, qr, 0.1)
    _check_rows(flat, out, q, qr, 0.1)  # the same codes as the unpaged cache's rows, bit for bit


@pytest.mark.parametrize("name", ["affine8/64", "affine4/32", "turbo-k8", "turbo-k4"])
@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
def test_sparse_gathered_columns_attend_on_gathered_codes(name, paged):
    """DSA's sparse step (``attend_gathered``) over batched rows of unequal length, columns picked in any order
    (padding columns included, masked as mlx-lm masks them): affine equals the ``quantized_matmul`` reference on the
    gathered planes bit for bit; TurboQuant equals mlx's fused attention over the decoded read gathered at the same
    columns bit for bit (what mlx-lm computes on a decoded read)."""
    fmt = FORMATS[name]
    flat = EncodedLatentCache(GEOMETRY, fmt)
    cache = PagedLatentCache(GEOMETRY, fmt, block_size=16) if paged else flat
    for c in {id(flat): flat, id(cache): cache}.values():
        singles = []
        for n in (40, 13):
            single = c.make_empty_batch()
            single.append_latent(_normal((1, n, 128), n), _normal((1, n, 64), n + 1))
            singles.append(single)
        c.merge_rows(singles)
        reads = c.store_latent(_normal((2, 1, 128), 7), _normal((2, 1, 64), 8))
    assert reads.on_planes
    width, K = reads.width, 9
    positions = mx.stack([mx.random.permutation(width, key=mx.random.key(b))[:K] for b in range(2)]).astype(mx.int32)
    visible = positions >= mx.array(reads.pads)[:, None]
    q = _normal((2, HEADS, 1, 128), 21)
    pe = mx.where(visible[:, None, None, :], _normal((2, HEADS, 1, K), 22), mx.finfo(mx.float32).min)
    out = attend_gathered(reads.plane_rows(), reads.pads, positions, q, 0.08, pe)
    if isinstance(fmt, AffineFormat):
        for b, pad in enumerate(reads.pads):
            planes = flat.row_state(b).planes[0]  # a paged row holds the same codes as the flat cache's row
            local = mx.clip(positions[b] - pad, 0, None)
            family = _reference_family(fmt, [mx.take(p, local, axis=1) for p in planes])
            scores = _qmm((q[b : b + 1] * 0.08).reshape(1, 1, HEADS, 128), family, True).reshape(1, HEADS, 1, K)
            weights = mx.softmax(scores + pe[b : b + 1], axis=-1, precise=True)
            ref = _qmm(weights.reshape(1, 1, HEADS, K), family, False).reshape(1, HEADS, 1, 128)
            assert mx.array_equal(out[b : b + 1], ref).item(), b
    else:
        read = reads.latent  # [B, width, r], zeros in padding
        k = mx.take_along_axis(read[:, None], mx.broadcast_to(positions[:, None, :, None], (2, 1, K, 128)), axis=2)
        ref = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.08, mask=pe)
        assert mx.array_equal(out, ref).item()
    decoded = attend_decoded(LatentAttentionState(
        mx.take_along_axis(reads.latent, mx.broadcast_to(positions[..., None], (2, K, 128)), axis=1),
        mx.zeros((2, K, 64))), q, 0.08, None, pe)
    bound = _tolerance(fmt) * max(1.0, mx.abs(decoded).max().item())
    assert mx.abs(out - decoded).max().item() <= bound


def test_float32_rows_keep_decode_then_attend_exactly():
    cache = EncodedLatentCache(GEOMETRY, FORMATS["turbo-k8"], start=64)
    cache.append_latent(_normal((1, 10, 128), 1), _normal((1, 10, 64), 2))
    reads = cache.store_latent(_normal((1, 1, 128), 3), _normal((1, 1, 64), 4))
    assert not reads.on_planes  # still reading its float32 shadow (f32 first)
    state = cache.read_latent()
    q, qr = _queries(1, 1, 5)
    expected = attend_decoded(LatentAttentionState(state.latent, state.rope), q, 0.1, qr)
    assert mx.array_equal(reads.attend(q, qr, 0.1), expected).item()


OPS = st.lists(st.one_of(
    st.tuples(st.just("decode"), st.integers(1, 3)),
    st.tuples(st.just("trim"), st.integers(0, 4)),
    st.tuples(st.just("rollback"), st.integers(1, 4)),
    st.tuples(st.just("filter"), st.integers(0, 2**6)),
), max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), ops=OPS,
       fmt=st.sampled_from(["affine4/32", "turbo-k8", "turbo-k4"]), seed=st.integers(0, 1000))
def test_attention_on_planes_over_any_rows_lengths_trims_rollbacks_merges_and_filters(lengths, ops, fmt, seed):
    fmt = FORMATS[fmt]
    singles = []
    for i, n in enumerate(lengths):
        single = EncodedLatentCache(GEOMETRY, fmt)
        single.append_latent(_normal((1, n, 128), seed + i), _normal((1, n, 64), seed + 50 + i))
        singles.append(single)
    cache = EncodedLatentCache(GEOMETRY, fmt)
    cache.merge_rows(singles)  # rows of unequal length: left padding that must never be attended
    for k, (op, arg) in enumerate(ops):
        rows = cache.batch_size
        if op == "decode":
            latent, rope = _normal((rows, arg, 128), seed + 100 + k), _normal((rows, arg, 64), seed + 200 + k)
            reads = cache.store_latent(latent, rope)
            assert reads.on_planes
            q, qr = _queries(rows, arg, seed + 300 + k)
            width = cache.offset
            causal = mx.arange(width)[None, :] <= (width - arg + mx.arange(arg))[:, None]
            out = reads.attend(q, qr, 0.1, causal[None, None])
            for b in range(rows):
                row = cache.row_state(b)
                ref = reference_row(fmt, row.planes, q[b : b + 1], qr[b : b + 1], 0.1,
                                    causal[None, None][..., width - row.offset :])
                assert mx.array_equal(out[b : b + 1], ref).item()
        elif op == "trim":
            cache.trim(min(arg, min(cache.row_offsets) - 1) if min(cache.row_offsets) > 1 else 0)
        elif op == "rollback":
            cache.spec_round_begin()
            cache.append_latent(_normal((rows, arg, 128), seed + 400 + k), _normal((rows, arg, 64), seed + 500 + k))
            cache.spec_round_rollback([(b + k) % (arg + 1) for b in range(rows)])
        elif op == "filter":
            keep = [b for b in range(rows) if (arg >> b) & 1] or [rows - 1]
            cache.filter_rows(keep)
    q, qr = _queries(cache.batch_size, 1, seed + 999)
    _check_rows(cache, cache.attend(q, qr, 0.1), q, qr, 0.1)


GREEDY_STEPS = 16
STEP_KL = 1e-3  # per decode step, the tiny models' logits on planes vs decode-then-attend


def _kl(reference, other):
    lp = reference - mx.logsumexp(reference, axis=-1, keepdims=True)
    lq = other - mx.logsumexp(other, axis=-1, keepdims=True)
    return mx.sum(mx.exp(lp) * (lp - lq)).item()


@pytest.mark.parametrize("name", MLA_NAMES)
@pytest.mark.parametrize("scheme", [KvScheme.affine(8, 32), KvScheme.turbo(8, 3), KvScheme.affine(4, 32)],
                         ids=["affine8", "turbo8", "affine4"])
@pytest.mark.parametrize("paged", [None, 8])
def test_tiny_mlx_lm_models_decode_the_same_greedy_tokens_on_the_planes(name, scheme, paged):
    model = build(name)
    on_planes = make_prompt_cache(model, scheme, paged_block_size=paged)
    decoded = make_prompt_cache(model, scheme, paged_block_size=paged)
    for cache in decoded:
        if isinstance(cache, LatentLayer):
            cache.attend_on_planes = False  # today's decode-then-attend
    tokens, logits = greedy(model, PROMPT, on_planes, steps=GREEDY_STEPS)
    expected, expected_logits = greedy(model, PROMPT, decoded, steps=GREEDY_STEPS)
    assert tokens == expected
    kl = max(_kl(want, got) for got, want in zip(logits, expected_logits))
    print(f"{name} {scheme.kind} paged={paged}: max step KL on planes vs decode-then-attend {kl:.2e}")
    assert kl < STEP_KL
    if name == "deepseek_v3":
        assert all(isinstance(c._reads[0], LatentKeys) for c in on_planes)  # the decode steps read the planes
    else:  # the DSA layers handed mlx-lm their placeholder and attended on the planes
        assert all(isinstance(c, DSALatentCache) and c._planes is not None and c._planes.reads.on_planes
                   for c in on_planes)


def test_a_decode_step_over_16k_encoded_positions_allocates_less_than_one_decoded_plane():
    T, geometry = 16384, LatentGeometry(512, 64)
    for fmt in (AffineFormat(8, 64), TurboFormat(8, 3), TurboFormat(4, 3)):
        cache = EncodedLatentCache(geometry, fmt)
        cache.append_latent(_normal((1, T, 512), 1), _normal((1, T, 64), 2))
        q, qr = mx.random.normal((1, 16, 1, 512)), mx.random.normal((1, 16, 1, 64))
        step = (mx.random.normal((1, 1, 512)), mx.random.normal((1, 1, 64)))
        for _ in range(2):  # the first step after the prefill may still grow the buffers
            mx.eval(cache.attend(q, qr, 0.05), cache.state, q, qr, *step)
            cache.store_latent(*step)
        mx.eval(cache.state)
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = cache.store_latent(*step).attend(q, qr, 0.05)
        mx.eval(out, cache.state)
        mx.synchronize()
        decoded_plane = T * 512 * 4
        assert mx.get_peak_memory() - before < decoded_plane, fmt
        # between steps the cache holds its planes only: no float32 array with a row per stored position and a
        # family's width (scales and biases are one value per group)
        held = cache.state
        assert not [a for a in held if a.dtype == mx.float32 and a.shape[-1] in geometry.widths]
        assert cache.nbytes < 0.4 * cache.offset * geometry.f32_bytes_per_token()


def test_turbo_k8_codes_are_held_as_offset_binary_and_persisted_as_the_encodings_bytes():
    """A TurboQuant k8 cache holds its signed codes with the top bit flipped (the uint8 bytes are ``idx + 128``,
    what ``quantized_matmul`` reads, so no step copies the codes to flip them); row states and pages written to a
    snapshot carry the encoding's own int8 codes, and taking them back restores the held bytes."""
    from kvshelf.latent_legos.encodings.family import family_encoding

    fmt = TurboFormat(8, 3)
    latent, rope = _normal((1, 40, 128), 3), _normal((1, 40, 64), 4)
    stored = family_encoding(fmt, 128).encode(latent)
    for cache in (EncodedLatentCache(GEOMETRY, fmt), PagedLatentCache(GEOMETRY, fmt, 16)):
        cache.append_latent(latent, rope)
        held_codes = cache.state[0] if isinstance(cache, EncodedLatentCache) else cache.pages[0].gather()[0]
        assert held_codes.dtype == mx.int8
        expected = (stored[0].astype(mx.int32) + 128).astype(mx.uint8)
        assert mx.array_equal(held_codes.view(mx.uint8), expected).item()
        if isinstance(cache, EncodedLatentCache):
            persisted = cache.row_state(0).planes[0]
            assert all(mx.array_equal(a, b).item() and a.dtype == b.dtype for a, b in zip(persisted, stored))
            again = cache.make_empty_batch()
            again.merge_row_states([cache.row_state(0)])
            assert all(mx.array_equal(a, b).item() for a, b in zip(again.state, cache.state))
        else:
            pools = cache.persisted_pools(cache.pages[0].pools)
            assert pools[0].dtype == mx.int8
            assert all(mx.array_equal(a, b).item() for a, b in zip(cache.held_pools(pools), cache.pages[0].pools))


@pytest.mark.parametrize("name", ["deepseek_v3", "llama"])
def test_the_installed_attention_leaves_plain_mlx_lm_models_and_caches_bit_identical(name, monkeypatch):
    """``install()`` replaces ``scaled_dot_product_attention`` in mlx-lm's base and model modules; a model on
    mlx-lm's own caches (``KVCache`` and the quantized path) must decode the same bits as with mlx-lm's function."""
    import sys

    from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache
    from mlx_lm_models import quantized_cache

    from kvshelf.mlx_lm.latent import attention

    attention.install()
    model = build(name)
    module = sys.modules[type(model).__module__]
    assert module.scaled_dot_product_attention is attention.scaled_dot_product_attention
    caches = [lambda: mlx_make_prompt_cache(model)] + ([lambda: quantized_cache(model)] if name == "llama" else [])
    for make in caches:
        patched = greedy(model, PROMPT, make(), steps=6)
        with monkeypatch.context() as m:
            m.setattr(module, "scaled_dot_product_attention", attention.scaled_dot_product_attention.mlx_lm_original)
            plain = greedy(model, PROMPT, make(), steps=6)
        assert patched[0] == plain[0]
        assert all(mx.array_equal(a, b).item() for a, b in zip(patched[1], plain[1]))
