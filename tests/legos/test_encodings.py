"""Family encodings: TurboQuant bit packing, key and value codes, affine, and the family planes contract."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.errors import InvalidCacheState
from kvshelf.latent_legos.encodings import family_encoding
from kvshelf.latent_legos.encodings import turboquant as tq
from kvshelf.latent_legos.encodings.tables import CENTROIDS, lloyd_max
from kvshelf.latent_legos.formats import AffineFormat, TurboFormat


def _stream_pack(codes: list[int], bits: int) -> list[int]:
    """Independent oracle: one big little-endian integer holding code i at bits [i*bits, (i+1)*bits)."""
    stream = sum(c << (i * bits) for i, c in enumerate(codes))
    return list(stream.to_bytes(len(codes) * bits // 8, "little"))


# ---------------------------------------------------------------------------------------------- bit packing


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 5, 8]),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    chunks=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_pack_unpack_round_trip_matches_bit_stream(bits, lead, chunks, seed):
    width = (8 // math.gcd(bits, 8)) * chunks  # the smallest whole-byte row for this width, times chunks
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(*lead, width), dtype=np.uint8)
    packed = tq.pack_bits(mx.array(codes), bits)
    assert packed.dtype == mx.uint8
    assert packed.shape == (*lead, width * bits // 8)
    flat_codes = codes.reshape(-1, width)
    flat_packed = np.array(packed).reshape(-1, width * bits // 8)
    for row_codes, row_bytes in zip(flat_codes, flat_packed):
        assert row_bytes.tolist() == _stream_pack(row_codes.tolist(), bits)
    back = tq.unpack_bits(packed, bits, width)
    assert back.dtype == mx.uint8
    assert np.array_equal(np.array(back), codes)


def test_pack_2bit_layout():
    v = [1, 2, 3, 0, 3, 3, 1, 2]
    packed = tq.pack_bits(mx.array([v], dtype=mx.uint8), 2).tolist()[0]
    assert packed == [1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 3 << 2 | 1 << 4 | 2 << 6] == [57, 159]


def test_pack_3bit_layout_eight_codes_in_three_bytes():
    v = [1, 2, 3, 4, 5, 6, 7, 0]
    b0 = v[0] | v[1] << 3 | (v[2] << 6) & 0xFF
    b1 = v[2] >> 2 | v[3] << 1 | v[4] << 4 | (v[5] << 7) & 0xFF
    b2 = v[5] >> 1 | v[6] << 2 | v[7] << 5
    assert [b0, b1, b2] == [209, 88, 31]
    assert tq.pack_bits(mx.array([v], dtype=mx.uint8), 3).tolist() == [[209, 88, 31]]


def test_pack_4bit_low_nibble_first_and_5bit_stream():
    assert tq.pack_bits(mx.array([[0x3, 0xA, 0xF, 0x1]], dtype=mx.uint8), 4).tolist() == [[0xA3, 0x1F]]
    assert tq.pack_bits(mx.array([[31, 0, 1, 2, 3, 4, 5, 6]], dtype=mx.uint8), 5).tolist() == [[31, 4, 49, 72, 49]]


def test_pack_8bit_is_identity_and_partial_bytes_rejected():
    codes = mx.array([[7, 200, 13]], dtype=mx.uint8)
    assert tq.pack_bits(codes, 8).tolist() == [[7, 200, 13]]
    with pytest.raises(InvalidCacheState, match="whole bytes"):
        tq.pack_bits(mx.zeros((1, 6), dtype=mx.uint8), 3)
    with pytest.raises(InvalidCacheState, match="bits must be one of"):
        tq.pack_bits(mx.zeros((1, 8), dtype=mx.uint8), 6)
    with pytest.raises(InvalidCacheState, match="uint8"):
        tq.pack_bits(mx.zeros((1, 8), dtype=mx.int32), 4)
    with pytest.raises(InvalidCacheState, match="need 3"):
        tq.unpack_bits(mx.zeros((1, 4), dtype=mx.uint8), 3, 8)


# ---------------------------------------------------------------------------------------------- key codes


def test_key_encoding_unsigned_4bit_hand_computed():
    x = mx.arange(32, dtype=mx.float32)[None]
    idx, scales, zeros = tq.encode_keys(x, 4)
    # scale = 31/15, zero = round(0) = 0, codes = round(x * 15/31): each pair of integers shares a code
    assert idx.dtype == mx.uint8 and scales.dtype == mx.float16 and zeros.dtype == mx.float16
    assert idx.tolist() == [[k // 2 for k in range(32)]]
    assert scales.tolist() == [[2.06640625]]  # float16(31/15)
    assert zeros.tolist() == [[0.0]]
    decoded = tq.decode_keys(idx, scales, zeros)
    assert decoded.dtype == mx.bfloat16
    # code * 2.06640625 rounded to bfloat16
    expected = [0.0, 2.0625, 4.125, 6.1875, 8.25, 10.3125, 12.375, 14.4375,
                16.5, 18.625, 20.625, 22.75, 24.75, 26.875, 28.875, 31.0]
    assert decoded.astype(mx.float32).tolist() == [[v for v in expected for _ in range(2)]]


def test_key_encoding_signed_8bit_hand_computed():
    x = (mx.arange(32, dtype=mx.float32) - 10)[None]
    idx, scales, zeros = tq.encode_keys(x, 8)
    # scale = 31/254, zero = round(11 / (2*scale)) = round(45.06) = 45, codes = clip(round(x/scale - 45), ±127)
    assert idx.dtype == mx.int8
    assert idx.tolist()[0] == [max(-127, min(127, round(v * 254 / 31 - 45))) for v in range(-10, 22)]
    assert idx.tolist()[0][:3] == [-127, -119, -111] and idx.tolist()[0][-1] == 127
    assert scales.tolist() == [[0.1220703125]] and zeros.tolist() == [[45.0]]
    decoded = tq.decode_keys(idx, scales, zeros).astype(mx.float32).tolist()[0]
    assert decoded[0] == -10.0 and decoded[10] == 0.0 and decoded[-1] == 21.0
    assert max(abs(d - v) for d, v in zip(decoded, range(-10, 22))) <= 0.07


@pytest.mark.parametrize("bits, bound", [(2, 0.6), (3, 0.26), (4, 0.13), (5, 0.065), (8, 0.012)])
def test_key_round_trip_error_is_half_a_step(bits, bound):
    x = mx.random.uniform(-1.0, 1.0, (8, 128), key=mx.random.key(3))
    idx, scales, zeros = tq.encode_keys(x, bits)
    err = mx.max(mx.abs(tq.decode_keys(idx, scales, zeros).astype(mx.float32) - x)).item()
    assert 0 < err <= bound


def test_constant_block_zero_overflows_float16_as_reference():
    x = mx.concatenate([mx.full((32,), 1.0), mx.full((32,), -1.0), mx.zeros((32,)), mx.full((32,), 1e-5)])[None]
    idx, scales, zeros = tq.encode_keys(x, 4)
    assert scales.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    z = zeros.tolist()[0]
    assert z[0] == math.inf and z[1] == -math.inf and z[2] == 0.0 and z[3] == 1000.0
    decoded = tq.decode_keys(idx, scales, zeros).astype(mx.float32).tolist()[0]
    assert all(math.isnan(v) for v in decoded[:64])  # (code + inf) * 0
    assert decoded[64:] == [0.0] * 64  # zeros stay zeros; a tiny constant collapses to 0 (scale 0)


def test_key_width_and_bits_validated():
    with pytest.raises(InvalidCacheState, match="multiple of 32"):
        tq.encode_keys(mx.zeros((1, 48)), 8)
    with pytest.raises(InvalidCacheState, match="bits must be one of"):
        tq.encode_keys(mx.zeros((1, 32)), 6)


# ---------------------------------------------------------------------------------------------- value codes


def test_hadamard_signs_match_reference_table_head():
    assert tq.hadamard_signs(64)[:16].tolist() == [1, -1, -1, -1, 1, 1, 1, -1, 1, 1, -1, 1, -1, 1, -1, 1]
    assert tq.hadamard_signs(128)[:10].tolist() == [-1, 1, -1, -1, 1, 1, 1, 1, -1, -1]


def test_lloyd_max_tables_shapes_and_reference_boundaries():
    for bits, centroids in CENTROIDS.items():
        assert len(centroids) == 2**bits
        assert list(centroids) == sorted(centroids)
    c5, b5 = lloyd_max(5)
    assert (c5[0].item(), c5[-1].item()) == (-3.3482043743133545, 3.2329483032226562)
    # reference boundaries (float32 midpoints), spot-checked
    assert b5[:2].tolist() == [-3.0613365173339844, -2.583125114440918]
    _, b8 = lloyd_max(8)
    assert b8.shape == (255,)
    assert b8[128:131].tolist() == [-0.04851963371038437, -0.013490559533238411, 0.022357644513249397]
    _, b3 = lloyd_max(3)
    assert b3.tolist() == [-1.7479300498962402, -1.0499600172042847, -0.5005499720573425, 0.0,
                           0.5005499720573425, 1.0499600172042847, 1.7479300498962402]
    _, b2 = lloyd_max(2)
    assert b2.tolist() == [-0.9863501191139221, -0.004796460270881653, 0.9803922176361084]


@pytest.mark.parametrize("bits, lo, hi", [(2, 0.09, 0.13), (3, 0.025, 0.038), (4, 0.007, 0.011), (5, 0.0018, 0.0032)])
def test_value_round_trip_mse_on_unit_normals(bits, lo, hi):
    x = mx.random.normal((64, 128), key=mx.random.key(7))
    idx, scales = tq.encode_values(x, bits)
    assert idx.dtype == mx.uint8 and idx.shape == (64, 128) and scales.shape == (64, 4)
    assert scales.dtype == mx.float16
    assert mx.max(idx).item() <= 2**bits - 1
    decoded = tq.decode_values(idx, scales, bits)
    assert decoded.dtype == mx.bfloat16
    mse = mx.mean((decoded.astype(mx.float32) - x) ** 2).item()
    assert lo < mse < hi


def test_value_codes_count_boundaries_below():
    # The rotation of a one-hot is ±1/8 everywhere (d = 64): every 32-group has RMS 1/8, so each normalised
    # coordinate is ±1 and counts the 3-bit boundaries strictly below it: 2 for −1, 5 for +1.
    x = mx.zeros((1, 64)).at[0, 0].add(1.0)
    idx, scales = tq.encode_values(x, 3)
    y = tq.rotate(x).tolist()[0]
    assert [abs(v) for v in y] == [0.125] * 64
    assert idx.tolist()[0] == [5 if v > 0 else 2 for v in y]
    assert scales.tolist()[0] == [0.125] * 2


# ---------------------------------------------------------------------------------------------- affine + families

FORMATS = [AffineFormat(8, 64), AffineFormat(4, 64), AffineFormat(4, 32), AffineFormat(2, 128),
           TurboFormat(8, 3), TurboFormat(5, 3), TurboFormat(4, 4), TurboFormat(3, 3), TurboFormat(2, 2)]


def _expected_planes(fmt, width, batch, length):
    if isinstance(fmt, AffineFormat):
        g = width // fmt.group_size
        return [((batch, length, width * fmt.bits // 32), mx.uint32), ((batch, length, g), mx.float32),
                ((batch, length, g), mx.float32)]
    g = width // 32
    codes = mx.int8 if fmt.k_bits == 8 else mx.uint8
    return [((batch, length, width * fmt.k_bits // 8), codes), ((batch, length, g), mx.float16),
            ((batch, length, g), mx.float16)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: repr(f))
def test_family_planes_shapes_dtypes_and_position_slices(fmt):
    width = 128
    enc = family_encoding(fmt, width)
    x = mx.random.normal((2, 5, width), key=mx.random.key(11))
    planes = enc.encode(x)
    assert enc.planes == 3 == len(planes)
    assert [(p.shape, p.dtype) for p in planes] == _expected_planes(fmt, width, 2, 5)
    decoded = enc.decode(planes)
    assert decoded.dtype == mx.float32 and decoded.shape == (2, 5, width)
    assert enc.plane_widths() == tuple(s[-1] for s, _ in _expected_planes(fmt, width, 2, 5))
    # per-position encoding: any slice along axis 1 equals the encoding of that slice
    part = enc.encode(x[:, 1:4])
    for whole, piece in zip(planes, part):
        assert mx.array_equal(whole[:, 1:4], piece).item()
    # zeros (padding) decode to zeros
    zeros = enc.decode([mx.zeros_like(p) for p in planes])
    assert mx.array_equal(zeros, mx.zeros((2, 5, width))).item()
    # empty positions
    empty = enc.encode(mx.zeros((2, 0, width)))
    assert [(p.shape, p.dtype) for p in empty] == _expected_planes(fmt, width, 2, 0)
    assert enc.decode(empty).shape == (2, 0, width)


def test_affine_family_equals_mlx_quantize_and_error_bound():
    enc = family_encoding(AffineFormat(8, 64), 128)
    x = mx.random.normal((1, 3, 128), key=mx.random.key(5))
    packed, scales, biases = enc.encode(x)
    ref = mx.quantize(x, group_size=64, bits=8)
    assert all(mx.array_equal(a, b).item() for a, b in zip((packed, scales, biases), ref))
    decoded = enc.decode([packed, scales, biases])
    assert mx.array_equal(decoded, mx.dequantize(*ref, group_size=64, bits=8)).item()
    step = mx.abs(mx.repeat(scales, 64, axis=-1))
    err = mx.abs(decoded - x)
    assert mx.all(err <= step).item()  # half a step inside the range; the snapped edge may cost the far end more
    assert mx.mean(err).item() < mx.mean(step).item() / 3
    # the larger-magnitude extreme of each group is exact
    groups = x.reshape(1, 3, 2, 64)
    far = mx.argmax(mx.abs(groups), axis=-1, keepdims=True)
    got = mx.take_along_axis(decoded.reshape(1, 3, 2, 64), far, axis=-1)
    assert mx.array_equal(got, mx.take_along_axis(groups, far, axis=-1)).item()


def test_turbo_family_decode_is_key_decode_through_bf16():
    enc = family_encoding(TurboFormat(3, 3), 64)
    x = mx.random.normal((1, 2, 64), key=mx.random.key(9))
    idx, scales, zeros = tq.encode_keys(x, 3)
    planes = enc.encode(x)
    assert mx.array_equal(planes[0], tq.pack_bits(idx, 3)).item()
    expected = tq.decode_keys(idx, scales, zeros).astype(mx.float32)
    assert mx.array_equal(enc.decode(planes), expected).item()


def test_family_width_validation():
    with pytest.raises(InvalidCacheState, match=r"width 100 .*group size 64"):
        family_encoding(AffineFormat(4, 64), 100)
    with pytest.raises(InvalidCacheState, match=r"width 48 .*32"):
        family_encoding(TurboFormat(8, 3), 48)
    with pytest.raises(InvalidCacheState, match="no family encoding"):
        family_encoding(None, 64)  # type: ignore[arg-type]


def test_family_rejects_bad_inputs_and_planes():
    enc = family_encoding(TurboFormat(4, 3), 64)
    with pytest.raises(InvalidCacheState, match=r"\[B, L, 64\]"):
        enc.encode(mx.zeros((2, 3, 32)))
    planes = enc.encode(mx.ones((1, 2, 64)))
    with pytest.raises(InvalidCacheState, match="expected 3 planes"):
        enc.decode(planes[:2])
    with pytest.raises(InvalidCacheState, match="plane 1"):
        enc.decode([planes[0], planes[1].astype(mx.float32), planes[2]])
    with pytest.raises(InvalidCacheState, match="plane 2"):
        enc.decode([planes[0], planes[1], planes[2][:, :1]])
