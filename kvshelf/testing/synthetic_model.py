"""A small deterministic GLM-style MLA attention stack with seeded synthetic weights.

It exists to measure what a latent cache's storage does to a model's output (logits KL between formats) and to
drive every latent cache through real prefill, decode and batched-row traffic without downloading weights.

Per layer, as in DeepSeek/GLM compressed MLA: the normalised hidden state is compressed to a latent
``[B, L, kv_lora_rank]`` (RMS-normed) and a decoupled RoPE key ``[B, L, rope_head_dim]`` (rotated at each token's
absolute position in its row), plus, on a sparse-attention layer, a DSA index key. The cache stores those and returns
float32 reads of every stored position; per-head keys and values are expanded from the latent read by
up-projections, so whatever the cache's storage loses reaches the attention. DSA's top-k selection is replaced by a
continuous stand-in: a ReLU index score added to every head's attention logits, so the index keys' encoding matters
without making the output jump.

A short step (decode, a speculative verify window: ``2 L < qk_nope_head_dim + v_head_dim``) uses the absorbed
form instead, as mlx-lm's DeepSeek/GLM attention does: the queries are projected into the latent space and the
attention output is projected out of it, so the step reads the cache once and materialises nothing of size T
beyond the scores; expanding keys and values for every stored position would copy the whole cache per token and
the benchmarks would measure the model instead of the cache. Both forms are deterministic; they agree to float32
rounding, not bit for bit, so a continuation is compared with the same step lengths.

Rows are right-justified (the caches' layout): before an append, ``row_offsets[b]`` is the position of the row's first
new column (negative across left padding prepared with ``prepare_prefill``); after it, ``left_pad[b]`` columns of row
b are hidden from every query. Everything runs in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..errors import CacheRangeError, InvalidCacheState
from ..latent_legos.contracts import LatentAttentionState
from ..latent_legos.latent.geometry import LatentGeometry

_NEG = -1e9  # finite, so a query that sees nothing (a padding column) stays finite instead of NaN


def _rms_norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


@dataclass(frozen=True)
class _Layer:
    wq: mx.array  # [hidden, heads * (nope + rope)]
    w_dkv: mx.array  # [hidden, kv_lora_rank]
    w_kr: mx.array  # [hidden, rope_head_dim]
    w_uk: mx.array  # [kv_lora_rank, heads * nope]
    w_uv: mx.array  # [kv_lora_rank, heads * v_head_dim]
    wo: mx.array  # [heads * v_head_dim, hidden]
    w_qi: mx.array | None  # [hidden, index_head_dim]
    w_ki: mx.array | None  # [hidden, index_head_dim]


class SyntheticMLAModel:
    """``model(tokens [B, L] int32, caches) -> logits float32 [B, L, vocab]``; one latent cache per layer."""

    def __init__(
        self,
        num_layers: int = 2,
        vocab: int = 256,
        hidden: int = 256,
        num_heads: int = 4,
        kv_lora_rank: int = 128,
        rope_head_dim: int = 64,
        index_head_dim: int | None = None,
        qk_nope_head_dim: int = 64,
        v_head_dim: int = 64,
        rope_theta: float = 10000.0,
        seed: int = 0,
    ) -> None:
        if rope_head_dim % 2:
            raise InvalidCacheState(f"rope_head_dim must be even (got {rope_head_dim})")
        self.num_layers, self.vocab, self.hidden, self.num_heads = num_layers, vocab, hidden, num_heads
        self.qk_nope_head_dim, self.v_head_dim, self.rope_theta = qk_nope_head_dim, v_head_dim, rope_theta
        self.geometry = LatentGeometry(kv_lora_rank, rope_head_dim, index_head_dim)
        embed_key, head_key, layers_key = mx.random.split(mx.random.key(seed), 3)

        def init(key: mx.array, shape: tuple[int, int], gain: float = 1.0) -> mx.array:
            return mx.random.normal(shape, key=key) * (gain / math.sqrt(shape[0]))

        h, r, dr, dn, dv = hidden, kv_lora_rank, rope_head_dim, qk_nope_head_dim, v_head_dim
        self.embed = mx.random.normal((vocab, h), key=embed_key)
        self.lm_head = init(head_key, (h, vocab), gain=4.0)
        self.layers: list[_Layer] = []
        for layer_key in mx.random.split(layers_key, num_layers):
            # eight keys per layer whether or not it has DSA weights, so the rest match across the two
            k = mx.random.split(layer_key, 8)
            self.layers.append(_Layer(
                wq=init(k[0], (h, num_heads * (dn + dr)), gain=1.5),
                w_dkv=init(k[1], (h, r)),
                w_kr=init(k[2], (h, dr)),
                w_uk=init(k[3], (r, num_heads * dn), gain=1.5),
                w_uv=init(k[4], (r, num_heads * dv)),
                wo=init(k[5], (num_heads * dv, h)),
                w_qi=init(k[6], (h, index_head_dim)) if index_head_dim else None,
                w_ki=init(k[7], (h, index_head_dim)) if index_head_dim else None,
            ))
        self._inv_freq = 1.0 / (rope_theta ** (mx.arange(0, dr, 2, dtype=mx.float32) / dr))
        weights = [w for layer in self.layers for w in vars(layer).values() if w is not None]
        mx.eval(self.embed, self.lm_head, self._inv_freq, weights)

    # ------------------------------------------------------------------------------------------------ caches

    def make_caches(self, scheme=None, paged_block_size: int | None = None, max_tokens: int | None = None) -> list:
        """One latent cache per layer: the scheme's composition, or plain f32 ``MLACache``s when no scheme/paging."""
        geometry = self.geometry if max_tokens is None else LatentGeometry(
            self.geometry.kv_lora_rank, self.geometry.rope_head_dim, self.geometry.index_head_dim, max_tokens
        )
        if scheme is None and paged_block_size is None:
            from ..latent_legos.latent.mla import MLACache

            return [MLACache(geometry) for _ in range(self.num_layers)]
        from ..latent_legos.latent.scheme import KvScheme, composed_latent_cache

        scheme = scheme if scheme is not None else KvScheme.bf16()
        return [composed_latent_cache(scheme, paged_block_size, layer, geometry) for layer in range(self.num_layers)]

    # ------------------------------------------------------------------------------------------------ forward

    def _rope(self, x: mx.array, positions: mx.array) -> mx.array:
        """Rotate ``x [B, L, ..., dr]`` (half-split layout) by ``positions [B, L]``."""
        angles = positions.astype(mx.float32)[..., None] * self._inv_freq  # [B, L, dr/2]
        for _ in range(x.ndim - 3):
            angles = mx.expand_dims(angles, -2)
        cos, sin = mx.cos(angles), mx.sin(angles)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    @staticmethod
    def _first_positions(cache, batch: int) -> list[int]:
        """Each row's position of the first column about to be appended (negative across prepared left padding)."""
        offsets = list(cache.row_offsets) if cache.batch_size is not None else []
        if not offsets:
            return [0] * batch
        if len(offsets) != batch:
            raise InvalidCacheState(f"tokens have {batch} rows but the cache holds {len(offsets)}")
        return offsets

    def _attend(self, layer: _Layer, x: mx.array, cache) -> mx.array:
        B, L, _ = x.shape
        H, dn, dr, dv = self.num_heads, self.qk_nope_head_dim, self.geometry.rope_head_dim, self.v_head_dim
        firsts = self._first_positions(cache, B)
        positions = mx.array(firsts, dtype=mx.int32)[:, None] + mx.arange(L, dtype=mx.int32)[None, :]

        q = (x @ layer.wq).reshape(B, L, H, dn + dr)
        q_nope, q_pe = q[..., :dn], self._rope(q[..., dn:], positions)
        latent = _rms_norm(x @ layer.w_dkv)
        k_pe = self._rope(x @ layer.w_kr, positions)
        index_keys = x @ layer.w_ki if layer.w_ki is not None else None

        absorbed = 2 * L < dn + dv
        scale = 1.0 / math.sqrt(dn + dr)
        if absorbed and layer.w_qi is None and hasattr(cache, "store_latent"):
            reads = cache.store_latent(latent, k_pe)
            if reads.on_planes:
                return self._attend_planes(layer, reads, q_nope, q_pe, scale, list(cache.left_pad))
            read = LatentAttentionState(reads.latent, reads.rope)
        else:
            read = cache.append_latent(latent, k_pe, index_keys)
        T = read.latent.shape[1]
        if absorbed:
            r = self.geometry.kv_lora_rank
            q_latent = mx.einsum("blhd,rhd->bhlr", q_nope, layer.w_uk.reshape(r, H, dn)).reshape(B, H * L, r)
            q_rope = q_pe.transpose(0, 2, 1, 3).reshape(B, H * L, dr)
            # stored positions on the left: one pass down the cache's rows (BLAS runs it ~2x faster than q @ c.T)
            scores = read.latent @ q_latent.transpose(0, 2, 1) + read.rope @ q_rope.transpose(0, 2, 1)
            scores = scores.transpose(0, 2, 1).reshape(B, H, L, T)
        else:
            k_nope = (read.latent @ layer.w_uk).reshape(B, T, H, dn)
            values = (read.latent @ layer.w_uv).reshape(B, T, H, dv)
            scores = mx.einsum("blhd,bthd->bhlt", q_nope, k_nope) + mx.einsum("blhd,btd->bhlt", q_pe, read.rope)
        scores = scores * scale
        if layer.w_qi is not None:
            q_idx = x @ layer.w_qi
            index_scores = mx.maximum(q_idx @ read.index_keys.transpose(0, 2, 1), 0) / math.sqrt(q_idx.shape[-1])
            scores = scores + index_scores[:, None]

        columns = mx.arange(T, dtype=mx.int32)
        query_columns = (T - L) + mx.arange(L, dtype=mx.int32)
        causal = columns[None, :] <= query_columns[:, None]  # [L, T]
        pads = mx.array(list(cache.left_pad), dtype=mx.int32)[:, None, None]
        visible = causal[None] & (columns[None, None, :] >= pads)  # [B, L, T]
        scores = mx.where(visible[:, None], scores, _NEG)
        weights = mx.softmax(scores, axis=-1)
        if absorbed:
            mixed = (weights.reshape(B, H * L, T) @ read.latent).reshape(B, H, L, r)
            out = mx.einsum("bhlr,rhd->blhd", mixed, layer.w_uv.reshape(r, H, dv)).reshape(B, L, H * dv)
        else:
            out = mx.einsum("bhlt,bthd->blhd", weights, values).reshape(B, L, H * dv)
        return out @ layer.wo

    def _attend_planes(self, layer: _Layer, reads, q_nope: mx.array, q_pe: mx.array, scale: float,
                       pads: list[int]) -> mx.array:
        """The absorbed step on an encoded cache's planes (``LatentReads.attend``): nothing of size T x r decoded."""
        B, L, H, dn = q_nope.shape
        r, dv, T = self.geometry.kv_lora_rank, self.v_head_dim, reads.width
        q_latent = mx.einsum("blhd,rhd->bhlr", q_nope, layer.w_uk.reshape(r, H, dn))
        columns = mx.arange(T, dtype=mx.int32)
        causal = columns[None, :] <= ((T - L) + mx.arange(L, dtype=mx.int32))[:, None]
        visible = causal[None] & (columns[None, None, :] >= mx.array(pads, dtype=mx.int32)[:, None, None])
        mixed = reads.attend(q_latent, q_pe.transpose(0, 2, 1, 3), scale, visible[:, None])
        out = mx.einsum("bhlr,rhd->blhd", mixed, layer.w_uv.reshape(r, H, dv)).reshape(B, L, H * dv)
        return out @ layer.wo

    def __call__(self, tokens: mx.array, caches: Sequence) -> mx.array:
        if tokens.ndim != 2:
            raise InvalidCacheState(f"tokens must be [B, L] (got {list(tokens.shape)})")
        if len(caches) != self.num_layers:
            raise InvalidCacheState(f"expected {self.num_layers} caches, got {len(caches)}")
        ids = tokens.astype(mx.int32)
        if ids.size:  # an id outside the vocabulary would make the gather read past the embedding table (a crash)
            low, high = mx.stack([mx.min(ids), mx.max(ids)]).tolist()  # one host sync, not two
            if low < 0 or high >= self.vocab:
                raise CacheRangeError(f"token ids must lie in [0, {self.vocab}) for this model's vocabulary "
                                      f"(got {low}..{high})")
        h = self.embed[ids]
        for layer, cache in zip(self.layers, caches):
            h = h + self._attend(layer, _rms_norm(h), cache)
        return _rms_norm(h) @ self.lm_head
