"""mlx-lm parity: one serial row of our KVCache / QuantizedKVCache / RotatingKVCache reads bit-identically to
mlx-lm's own class on the same appends, trims and masks, and mlx-lm's attention runs on our outputs unchanged.

When mlx-lm is not importable the same sequences are checked against a plain concatenating reference instead (the
module never skips)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cases import flat, kv, same

from kvshelf.latent_legos.kv import KVCache, QuantizedKVCache, RotatingKVCache

try:
    import mlx_lm.models.cache  # noqa: F401  (the oracle when installed)

    HAVE_MLX_LM = True
except ImportError:
    HAVE_MLX_LM = False


class ConcatReference:
    """What a serial cache must read: every appended position in order, cut by trims (no capacity, no steps)."""

    def __init__(self, quant: tuple[int, int] | None = None) -> None:
        self.keys = self.values = None
        self.offset = 0
        self.quant = quant

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            keys = mx.concatenate([self.keys[:, :, : self.offset], keys], axis=2)
            values = mx.concatenate([self.values[:, :, : self.offset], values], axis=2)
        self.keys, self.values, self.offset = keys, values, keys.shape[2]
        if self.quant is None:
            return keys, values
        g, b = self.quant
        return tuple(mx.quantize(keys, group_size=g, bits=b)), tuple(mx.quantize(values, group_size=g, bits=b))

    def trim(self, n):
        n = min(n, self.offset)
        self.offset -= n
        return n


def reference(kind: str):
    if HAVE_MLX_LM:
        from mlx_lm.models import cache as C

        makers = {"kv": C.KVCache, "qkv8": lambda: C.QuantizedKVCache(64, 8), "qkv4": lambda: C.QuantizedKVCache(32, 4)}
        return makers[kind]()
    return ConcatReference({"kv": None, "qkv8": (64, 8), "qkv4": (32, 4)}[kind])


OURS = {"kv": KVCache, "qkv8": lambda: QuantizedKVCache(64, 8), "qkv4": lambda: QuantizedKVCache(32, 4)}

ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.sampled_from([1, 1, 2, 7, 130, 300])),
        st.tuples(st.just("trim"), st.integers(0, 40)),
    ),
    min_size=1,
    max_size=8,
)


@pytest.mark.parametrize("kind", ["kv", "qkv8", "qkv4"])
@settings(max_examples=25)
@given(ops=ops)
def test_serial_reads_match_mlx_lm_bit_for_bit(kind, ops):
    ours, ref = OURS[kind](), reference(kind)
    for i, (op, n) in enumerate(ops):
        if op == "trim":
            assert ours.trim(n) == ref.trim(n)
            continue
        keys, values = kv(1, n, i)
        a, b = ours.update_and_fetch(keys, values), ref.update_and_fetch(keys, values)
        assert same(flat(a), flat(b))
        assert ours.offset == ref.offset
        for n_q in (1, 5):
            for window in (None, 3):
                for as_array in (False, True):
                    got = ours.make_mask(n_q, return_array=as_array, window_size=window)
                    if HAVE_MLX_LM:
                        assert same(got, ref.make_mask(n_q, return_array=as_array, window_size=window))
                    elif window is None and not as_array:
                        assert got == (None if n_q == 1 else "causal")


def test_reference_is_the_installed_mlx_lm_when_present():
    """Documents which oracle ran: mlx-lm's own classes when installed (the benchmarks install it)."""
    ref = reference("kv")
    assert (type(ref).__module__ == "mlx_lm.models.cache") == HAVE_MLX_LM


def test_capacity_grows_in_256_steps_and_reads_are_cut_to_offset():
    cache = KVCache()
    fill_keys, fill_values = kv(1, 7, 0)
    keys, values = cache.update_and_fetch(fill_keys, fill_values)
    assert cache.keys.shape == (1, 2, 256, 64) and keys.shape == (1, 2, 7, 64)
    cache.update_and_fetch(*kv(1, 300, 1))
    assert cache.keys.shape == (1, 2, 7 + 512, 64)  # cut to the offset, then 2 steps of zeros
    assert cache.trim(10) == 10 and cache.offset == 297 and cache.keys.shape[2] == 519
    assert cache.trim(10_000) == 297 and cache.offset == 0  # clamped, as mlx-lm


def test_to_quantized_matches_mlx_lm_and_carries_offset_and_floor():
    ours = KVCache()
    for i, n in enumerate([5, 1, 300]):
        ours.update_and_fetch(*kv(1, n, i))
    ours.minimum_reusable_offset = 6
    q = ours.to_quantized(group_size=64, bits=4)
    assert isinstance(q, QuantizedKVCache) and q.signature() == "kv:quant:4:64"
    assert (q.offset, q.minimum_reusable_offset, q.row_offsets) == (306, 6, [306])
    expected = [mx.quantize(p, group_size=64, bits=4) for p in ours.state]
    assert same(list(q.state), [a for triple in expected for a in triple])
    if HAVE_MLX_LM:
        from mlx_lm.models import cache as C

        ref = C.KVCache()
        for i, n in enumerate([5, 1, 300]):
            ref.update_and_fetch(*kv(1, n, i))
        rq = ref.to_quantized(group_size=64, bits=4)
        assert same(flat(q.update_and_fetch(*kv(1, 1, 9))), flat(rq.update_and_fetch(*kv(1, 1, 9))))
    assert ours.offset == 306  # the source is left as it was


@pytest.mark.parametrize("max_size,keep,steps", [
    (16, 0, [5, 1, 1, 20, 1, 1, 1, 3, 1]),
    (16, 2, [1] * 20 + [7, 1, 1]),
    (8, 0, [3, 3, 3] + [1] * 9 + [2, 1]),
    (300, 4, [200, 1, 120, 1, 1]),
])
def test_rotating_ring_matches_mlx_lm(max_size, keep, steps):
    ours = RotatingKVCache(max_size, keep)
    ref = None
    if HAVE_MLX_LM:
        from mlx_lm.models import cache as C

        ref = C.RotatingKVCache(max_size, keep)
    history_k, history_v = [], []
    for i, n in enumerate(steps):
        keys, values = kv(1, n, 50 + i, dv=32)
        history_k.append(keys)
        history_v.append(values)
        got = ours.update_and_fetch(keys, values)
        if ref is not None:
            assert same(got, ref.update_and_fetch(keys, values))
            assert (ours.offset, ours.idx) == (ref.offset, ref._idx)
            for n_q in (1, 3):
                for window in (None, 4):
                    assert same(ours.make_mask(n_q, window_size=window), ref.make_mask(n_q, window_size=window))
        all_k = mx.concatenate(history_k, axis=2)
        if ours.offset <= max_size:  # before the wrap the ring reads every position in order
            assert same(got[0], all_k[:, :, : ours.offset])
        else:  # after it, the ring holds the keep positions and the newest ones (in ring order)
            expect = {tuple(np.array(all_k[0, 0, t].astype(mx.float32)).tolist()) for t in range(keep)}
            expect |= {tuple(np.array(all_k[0, 0, t].astype(mx.float32)).tolist())
                       for t in range(ours.offset - (got[0].shape[2] - keep), ours.offset)}
            held = {tuple(np.array(got[0][0, 0, s].astype(mx.float32)).tolist()) for s in range(got[0].shape[2])}
            assert held == expect


def test_mlx_lm_attention_runs_on_our_caches():
    """mlx-lm's SDPA helper picks the quantized path from our cache's ``bits`` and gives its own cache's output."""
    queries = mx.random.normal((1, 4, 3, 64), key=mx.random.key(7)).astype(mx.bfloat16)
    for kind in ("kv", "qkv8"):
        ours = OURS[kind]()
        ref = reference(kind)
        for i, n in enumerate([9, 3]):
            a = ours.update_and_fetch(*kv(1, n, 70 + i))
            b = ref.update_and_fetch(*kv(1, n, 70 + i))
        if HAVE_MLX_LM:
            from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

            hidden = mx.zeros((1, 3, 8))
            mask = create_attention_mask(hidden, ours)
            assert mask == create_attention_mask(hidden, ref) == "causal"
            # mlx-lm's quantized path scales its queries argument in place: give each call its own copy
            out = scaled_dot_product_attention(mx.array(queries), *a, cache=ours, scale=0.125, mask=mask)
            expect = scaled_dot_product_attention(mx.array(queries), *b, cache=ref, scale=0.125, mask=mask)
        else:
            if kind == "qkv8":
                a = [mx.dequantize(*t, group_size=64, bits=8) for t in a]
                b = [mx.dequantize(*t, group_size=64, bits=8) for t in b]
            out = mx.fast.scaled_dot_product_attention(queries, *a, scale=0.125, mask="causal")
            expect = mx.fast.scaled_dot_product_attention(queries, *b, scale=0.125, mask="causal")
        assert out.shape == (1, 4, 3, 64) and same(out, expect)


ring_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.sampled_from([1, 1, 1, 2, 5, 9])),
        st.tuples(st.just("trim"), st.integers(0, 4)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=40)
@given(ops=ring_ops, max_size=st.sampled_from([4, 8, 13]), keep=st.sampled_from([0, 2]))
def test_ring_random_sequences_read_like_mlx_lm_or_the_window_rule(ops, max_size, keep):
    ours = RotatingKVCache(max_size, keep)
    ref = None
    if HAVE_MLX_LM:
        from mlx_lm.models import cache as C

        ref = C.RotatingKVCache(max_size, keep)
    seen = 0
    for i, (op, n) in enumerate(ops):
        if op == "trim":
            if ours.is_trimmable():
                expected = ref.trim(n) if ref is not None else min(n, ours.offset)
                assert ours.trim(n) == expected
            continue
        keys, values = kv(1, n, 300 + i, heads=1, dk=32, dv=32)
        got = ours.update_and_fetch(keys, values)
        seen = ours.offset
        if ref is not None:
            assert same(got, ref.update_and_fetch(keys, values))
            assert (ours.offset, ours.idx) == (ref.offset, ref._idx)
        else:  # the read always holds at least min(offset, max_size) positions, the newest block last when concatenated
            assert got[0].shape[2] >= min(seen, max_size)
            if n > 1:
                assert same(got[0][:, :, -n:], keys)
