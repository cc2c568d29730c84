"""Attention computed on the encoded latent planes, with no decoded copy of the history.

An encoded latent cache exists to save memory; decoding every stored position into a float32 ``[B, T, W]`` read at
each decode step gives that memory back (and costs a pass over it). Both encodings are per-group affine along the
width, which is the layout ``mx.quantized_matmul`` reads (``w = scale * q + bias`` per group, codes packed
little-endian into uint32), so absorbed-MLA attention runs on the planes themselves:

* scores ``q_latent · latentᵀ`` and, for the RoPE key, ``q_rope · ropeᵀ``: one ``quantized_matmul`` each with the
  heads (and the step's queries) folded into the rows of one product, ``[1, 1, H·L, r]`` against ``[1, 1, T, ·]``;
* the output ``p · latent``: one ``quantized_matmul`` with ``transpose=False``.

Affine planes (``mx.quantize``: packed uint32, float32 scales and biases) are read as stored. TurboQuant's key code
is ``(idx + zero) * scale`` per group of 32 with float16 scale and zero; its bit-packed codes below 8 bits are
already mlx's packing (code i at stream bits ``[i·b, (i+1)·b)``), so they are read through a uint32 view; its
8-bit codes are signed, so caches hold them with the top bit flipped (``family_codec``'s held form: offset binary,
``q = idx + 128``, transcoded once at append and flipped back only for persistence), read through a view as well. Per step the scales and ``bias = scale · (zero - offset)`` are widened to float32 ``[T, groups]``
(1/32 of a decoded plane's values). Decode-then-attend rounds TurboQuant reads to bfloat16 first; the product on
the planes does not, so the two differ in the last bits (see ``docs/latent-attention.md``).

Rows of a batch are attended one at a time over their own stored positions (a row's slice of the right-justified
buffers is contiguous, so ``quantized_matmul`` reads it in place; padding is never read). Per row the products are
``O(T)`` reads of the codes, and nothing of size ``T × W`` is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ...errors import InvalidCacheState
from ..contracts import LatentAttentionState
from ..formats import AffineFormat, LatentFormat, TurboFormat

TURBO_GROUP = 32
_F32 = mx.float32
_TOP_BIT = mx.array(0x80, dtype=mx.uint8)


@dataclass(frozen=True)
class QuantizedFamily:
    """One row's family in mlx's affine layout: ``codes [1, T, W·bits/32]`` uint32, ``scales``/``biases``
    ``[1, T, W/group]`` float32."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    stored: tuple[mx.array, ...] | None = None  # TurboQuant: the held planes, for a decode with the format's bits
    format: LatentFormat | None = None

    @property
    def length(self) -> int:
        return self.codes.shape[1]

    def matmul(self, x: mx.array, transpose: bool) -> mx.array:
        """``x @ familyᵀ`` (``transpose``) or ``x @ family`` with ``x`` ``[1, 1, M, ·]``."""
        return mx.quantized_matmul(x, self.codes[:, None], self.scales[:, None], self.biases[:, None],
                                   transpose=transpose, group_size=self.group_size, bits=self.bits)

    def decode(self) -> mx.array:
        return mx.dequantize(self.codes, self.scales, self.biases, group_size=self.group_size, bits=self.bits)

    @property
    def rounds_on_decode(self) -> bool:
        """Whether the format's decode differs from the affine values ``quantized_matmul`` uses (TurboQuant rounds
        every value to bfloat16)."""
        return self.stored is not None

    def decode_at(self, positions: mx.array) -> mx.array:
        """The family at ``positions`` (``[K]`` int32) decoded exactly as the format decodes (the bits of a decoded
        read gathered there): the held planes of those positions gathered, then decoded; ``[1, K, W]`` float32."""
        if self.stored is None or self.format is None:
            return self.take(positions).decode()
        from ..encodings.family import family_encoding

        planes = [mx.take(p, positions, axis=1) for p in self.stored]
        if isinstance(self.format, TurboFormat) and self.format.k_bits == 8:  # held offset binary -> signed codes
            planes[0] = (planes[0].view(mx.uint8) ^ _TOP_BIT).view(mx.int8)
        width = planes[1].shape[-1] * TURBO_GROUP
        return family_encoding(self.format, width).decode(planes)

    def take(self, positions: mx.array) -> QuantizedFamily:
        """The family at ``positions`` (``[K]`` int32, in ``[0, length)``): its codes, scales and biases gathered,
        never decoded values."""
        return QuantizedFamily(mx.take(self.codes, positions, axis=1), mx.take(self.scales, positions, axis=1),
                               mx.take(self.biases, positions, axis=1), self.bits, self.group_size)


def quantized_family(fmt: LatentFormat, planes: Sequence[mx.array]) -> QuantizedFamily:
    """One row's stored planes of one family (``[1, T, ·]`` each) as ``quantized_matmul`` reads them."""
    if isinstance(fmt, AffineFormat):
        codes, scales, biases = planes
        return QuantizedFamily(codes, scales, biases, fmt.bits, fmt.group_size)
    if isinstance(fmt, TurboFormat):
        codes, scales, zeros = planes
        scales = scales.astype(_F32)
        if fmt.k_bits == 8:  # held pre-flipped (family_codec): the bytes are offset binary, idx + 128
            codes = codes.view(mx.uint8)
            biases = scales * (zeros.astype(_F32) - 128.0)
        else:
            biases = scales * zeros.astype(_F32)
        return QuantizedFamily(codes.view(mx.uint32), scales, biases, fmt.k_bits, TURBO_GROUP, tuple(planes), fmt)
    raise InvalidCacheState(f"no attention on planes of format {fmt!r}")


def planes_attendable(fmt: LatentFormat | None, widths: Sequence[int]) -> bool:
    """Whether the latent and RoPE families of ``fmt`` pack into whole uint32 words (every format kvshelf offers at
    widths that are multiples of 32 does)."""
    if fmt is None:
        return False
    bits = fmt.bits if isinstance(fmt, AffineFormat) else fmt.k_bits
    return all((w * bits) % 32 == 0 for w in widths[:2])


@dataclass(frozen=True)
class PlaneRow:
    """One row's stored positions: its latent and RoPE families, and where they end (right-justified at ``width``)."""

    latent: QuantizedFamily
    rope: QuantizedFamily

    @property
    def length(self) -> int:
        return self.latent.length


def _row_mask(mask: mx.array | None, b: int, pad: int) -> mx.array | None:
    if mask is None:
        return None
    m = mask[b : b + 1] if mask.ndim == 4 and mask.shape[0] > 1 else mask
    return m[..., pad:]


def _apply_mask(scores: mx.array, mask: mx.array | None) -> mx.array:
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask


def attend_rows(
    rows: Sequence[PlaneRow],
    width: int,
    q_latent: mx.array,
    scale: float,
    q_rope: mx.array | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """Absorbed attention of ``q_latent [B, H, L, r]`` (and ``q_rope [B, H, L, d]``) over each row's planes.

    ``mask`` (``[B|1, H|1, L, width]``) is boolean (False hides a column) or additive (mlx-lm hands the RoPE
    scores, already masked, as an additive mask; then ``q_rope`` is None). Row b's columns are the last
    ``rows[b].length`` of ``width``; its padding is never read. Returns ``[B, H, L, r]`` float32.
    """
    B, H, L, r = q_latent.shape
    if len(rows) != B:
        raise InvalidCacheState(f"queries have {B} rows, the cache {len(rows)}")
    outs = []
    for b, row in enumerate(rows):
        T = row.length
        if T == 0:
            outs.append(mx.zeros((1, H, L, r), dtype=_F32))
            continue
        q = (q_latent[b : b + 1].astype(_F32) * scale).reshape(1, 1, H * L, r)
        scores = row.latent.matmul(q, transpose=True)
        if q_rope is not None:
            qr = (q_rope[b : b + 1].astype(_F32) * scale).reshape(1, 1, H * L, q_rope.shape[-1])
            scores = scores + row.rope.matmul(qr, transpose=True)
        scores = _apply_mask(scores.reshape(1, H, L, T), _row_mask(mask, b, width - T))
        weights = mx.softmax(scores, axis=-1, precise=True)
        outs.append(row.latent.matmul(weights.reshape(1, 1, H * L, T), transpose=False).reshape(1, H, L, r))
    return outs[0] if B == 1 else mx.concatenate(outs, axis=0)


def attend_gathered(
    rows: Sequence[PlaneRow],
    pads: Sequence[int],
    positions: mx.array,
    q_latent: mx.array,
    scale: float,
    mask: mx.array | None,
    dtype: mx.Dtype | None = None,
) -> mx.array:
    """Sparse absorbed attention (DSA): row b attends its latent at ``positions[b]`` (``[B, K]`` int32, columns of
    the right-justified buffers, as mlx-lm's ``take_along_axis`` on a decoded read gathers them, in that order).

    The codes, scales and biases of those positions are gathered; nothing is decoded. ``mask`` is additive
    ``[B|1, H, L, K]`` (mlx-lm's RoPE scores at the same positions, already masked). A position in a row's left
    padding, which a decoded read holds as zeros, reads the row's first stored position here instead: its
    column is masked by the RoPE scores, so its weight is zero either way. Returns ``[B, H, L, r]`` float32.
    TurboQuant rows are the exception (see the body): decoded at the K positions, attended in ``dtype``.
    """
    B, H, L, r = q_latent.shape
    if len(rows) != B or positions.shape[0] != B:
        raise InvalidCacheState(f"queries have {B} rows, the cache {len(rows)}, the positions {positions.shape[0]}")
    K, outs = positions.shape[-1], []
    locals_ = [mx.clip(positions[b] - pad, 0, max(row.length - 1, 0)) if pad else positions[b]
               for b, (row, pad) in enumerate(zip(rows, pads))]
    if B and rows[0].latent.rounds_on_decode:
        # TurboQuant: the K selected rows decoded with the format's own bits (padding as the zeros a decoded read
        # holds there) and mlx's fused attention, as mlx-lm attends its gather of a decoded read: the same bits.
        # The sparse selection turns last-bit differences into other top-k picks a few steps on, so this path
        # keeps today's numbers exactly; its cost is K rows, never the history.
        keys = []
        for b, (row, pad, local) in enumerate(zip(rows, pads, locals_)):
            k = row.latent.decode_at(local)
            keys.append(mx.where((positions[b] >= pad)[None, :, None], k, 0.0) if pad else k)
        k = (keys[0] if B == 1 else mx.concatenate(keys, axis=0))[:, None].astype(dtype or _F32)
        return mx.fast.scaled_dot_product_attention(q_latent, k, k, scale=scale, mask=mask)
    for b, (row, pad) in enumerate(zip(rows, pads)):
        family = row.latent.take(locals_[b])
        q = (q_latent[b : b + 1].astype(_F32) * scale).reshape(1, 1, H * L, r)
        scores = family.matmul(q, transpose=True).reshape(1, H, L, K)
        m = None if mask is None else (mask[b : b + 1] if mask.ndim == 4 and mask.shape[0] > 1 else mask)
        scores = _apply_mask(scores, m)
        weights = mx.softmax(scores, axis=-1, precise=True)
        outs.append(family.matmul(weights.reshape(1, 1, H * L, K), transpose=False).reshape(1, H, L, r))
    return outs[0] if B == 1 else mx.concatenate(outs, axis=0)


def attend_decoded(
    state: LatentAttentionState,
    q_latent: mx.array,
    scale: float,
    q_rope: mx.array | None = None,
    mask: mx.array | None = None,
    pads: Sequence[int] | None = None,
) -> mx.array:
    """Decode-then-attend: the same attention over float32 reads ``[B, T, W]`` (zeros in padding), what rows still
    reading float32 (or a float32 cache) compute. Padding columns (``pads``) are hidden."""
    B, H, L, r = q_latent.shape
    T = state.latent.shape[1]
    k = state.latent[:, None]
    scores = (q_latent.astype(_F32) * scale) @ k.swapaxes(-1, -2)
    if q_rope is not None:
        scores = scores + (q_rope.astype(_F32) * scale) @ state.rope[:, None].swapaxes(-1, -2)
    scores = _apply_mask(scores, mask)
    if pads is not None and any(pads):
        visible = mx.arange(T)[None, :] >= mx.array(list(pads))[:, None]
        scores = mx.where(visible[:, None, None, :], scores, mx.finfo(scores.dtype).min)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return weights @ k


class LatentReads:
    """What a ``store_latent`` append hands back: the attention over every stored position, and the float32
    reads only when asked for.

    ``rows`` (a callable, so the buffers' views are taken when the attention runs, never held across an append)
    gives the rows' planes when every row reads its encoded planes; otherwise ``decode`` gives the reads the way
    ``append_latent`` returns them (float32 rows, the f32-first shadow, a float32 cache) and attention is
    decode-then-attend over them, today's exact numbers.
    """

    def __init__(
        self,
        width: int,
        pads: Sequence[int],
        decode: Callable[[int], mx.array],
        rows: Callable[[], list[PlaneRow]] | None = None,
        mixed: Sequence[bool] | None = None,
    ) -> None:
        self.width = width
        self.pads = list(pads)
        self._decode = decode
        self._rows = rows if mixed is None else None
        self._mixed_rows = rows if mixed is not None else None
        self.mixed = list(mixed) if mixed is not None else None
        self._decoded: dict[int, mx.array] = {}

    @property
    def on_planes(self) -> bool:
        """Whether attention reads the encoded planes (no decoded history)."""
        return self._rows is not None

    def mixed_rows(self) -> list[PlaneRow | None]:
        """A batch where some rows read planes and some still read float32 (``mixed``): per row its planes, or None
        for a row whose read is ``latent``/``rope`` (the f32-first shadow). Only the mlx-lm faces use it, to attend
        each row exactly as its serial run would; ``attend`` keeps decode-then-attend for such a batch."""
        if self._mixed_rows is None:
            raise InvalidCacheState("these reads are not a mixed batch")
        return self._mixed_rows()

    def family(self, i: int) -> mx.array:
        """Family ``i`` decoded, ``[B, T, W_i]`` float32, zeros in padding. Reads on planes decode on every ask and
        keep nothing (whoever holds these reads between steps must not hold a decoded family with them)."""
        if self._rows is not None or self._mixed_rows is not None:
            return self._decode(i)
        if i not in self._decoded:
            self._decoded[i] = self._decode(i)
        return self._decoded[i]

    @property
    def latent(self) -> mx.array:
        return self.family(0)

    @property
    def rope(self) -> mx.array:
        return self.family(1)

    @property
    def index_keys(self) -> mx.array:
        return self.family(2)

    def plane_rows(self) -> list[PlaneRow]:
        if self._rows is None:
            raise InvalidCacheState("these reads are float32: no encoded planes to attend on")
        return self._rows()

    def attend(
        self, q_latent: mx.array, q_rope: mx.array | None, scale: float, mask: mx.array | None = None
    ) -> mx.array:
        """Absorbed attention ``softmax(scale · (q_latent·latentᵀ + q_rope·ropeᵀ) + mask) · latent`` over every
        stored position, ``[B, H, L, r]`` float32; padding is never attended (``attend_rows`` documents ``mask``)."""
        if self._rows is not None:
            return attend_rows(self._rows(), self.width, q_latent, scale, q_rope, mask)
        state = LatentAttentionState(self.latent, self.rope)
        return attend_decoded(state, q_latent, scale, q_rope, mask, self.pads)


def decoded_reads(state: LatentAttentionState, pads: Sequence[int]) -> LatentReads:
    """``LatentReads`` over reads already decoded (a float32 cache, rows reading the f32 shadow)."""
    families = [state.latent, state.rope] + ([state.index_keys] if state.index_keys is not None else [])
    width = families[0].shape[1]
    return LatentReads(width, pads, lambda i: families[i])


__all__ = [
    "LatentReads",
    "PlaneRow",
    "QuantizedFamily",
    "attend_decoded",
    "attend_gathered",
    "attend_rows",
    "decoded_reads",
    "planes_attendable",
    "quantized_family",
]
