"""How mlx-lm's MLA attention code reaches kvshelf's attention on the encoded planes, unchanged.

mlx-lm's absorbed-MLA decode (deepseek_v3, glm4_moe_lite, deepseek_v32 / glm_moe_dsa) does, per layer and step::

    kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)
    pe_scores = (q_pe * scale) @ k_pe.swapaxes(-1, -2)          # masked with mx.where when a mask is given
    q_nope = self.embed_q(q_nope); k = v = kv_latent           # L == 1
    out = scaled_dot_product_attention(q_nope, k, v, cache=cache, scale=scale, mask=pe_scores)

At a decode step (L == 1) over an encoded latent lego, the face's ``update_and_fetch`` returns the latent as
``LatentKeys`` (the step's ``LatentReads``: the planes, nothing decoded) and the RoPE key decoded (its small family,
``[B, 1, T, rope]``, which the model multiplies itself). ``scaled_dot_product_attention`` below is mlx-lm's own
function with one dispatch added in front: latent keys go to ``LatentReads.attend`` with ``pe_scores`` as the
additive mask (``quantized_matmul`` on the planes, heads folded); everything else goes to mlx-lm's function as
before. mlx-lm's own quantized path cannot serve here: it broadcasts deepseek's per-head mask against its
grouped-head scores and fails for more than one head.

``install()`` puts it where mlx-lm's model modules look the name up (``mlx_lm.models.base`` and every loaded model
module that imported base's function); ``make_prompt_cache`` and every decode step that hands out ``LatentKeys``
(a restored face, too) call it, so a model built before or after runs through it. It is idempotent and changes
nothing for caches that are not kvshelf's.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

from ...errors import InvalidCacheState
from ...latent_legos.latent.plane_attention import LatentReads, attend_rows


class LatentKeys:
    """The latent of one decode step as mlx-lm's attention sees it: ``reads`` (on the planes) in ``dtype``.

    ``shape`` is what the read would be (``[B, 1, T, r]``); ``array()`` decodes it for a caller that insists on an
    array (nothing in mlx-lm's decode path does).
    """

    def __init__(self, reads: LatentReads, batch: int, rank: int, dtype: mx.Dtype) -> None:
        self.reads, self.dtype = reads, dtype
        self.shape = (batch, 1, reads.width, rank)
        self.ndim = 4

    def array(self) -> mx.array:
        return self.reads.latent[:, None].astype(self.dtype)

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """mlx-lm's absorbed decode: ``queries [B, H, 1, r]``, ``mask`` the masked RoPE scores (or None)."""
        if isinstance(mask, str):
            if queries.shape[2] != 1:
                raise InvalidCacheState("kvshelf's latent attention takes a causal mask string only at a decode step")
            mask = None
        if self.reads.on_planes:
            return self.reads.attend(queries, None, scale, mask).astype(queries.dtype)
        return self._attend_mixed(queries, scale, mask)

    def _attend_mixed(self, queries: mx.array, scale: float, mask: mx.array | None) -> mx.array:
        """A batch of rows on planes and rows still reading float32: each row as its serial run attends, the planes
        through ``attend_rows``, a float32 row through mlx's fused attention over its own positions."""
        width, outs = self.reads.width, []
        for b, (row, pad) in enumerate(zip(self.reads.mixed_rows(), self.reads.pads)):
            m = None if mask is None else (mask[b : b + 1] if mask.shape[0] > 1 else mask)
            q = queries[b : b + 1]
            if row is not None:  # attend_rows reads the row's own columns of the mask
                outs.append(attend_rows([row], width, q, scale, None, m).astype(queries.dtype))
            else:
                k = self.reads.latent[b : b + 1, pad:][:, None].astype(self.dtype)
                m = None if m is None else m[..., pad:]
                outs.append(mx.fast.scaled_dot_product_attention(q, k, k, scale=scale, mask=m))
        return mx.concatenate(outs, axis=0)


def _mlx_lm_sdpa():
    from mlx_lm.models import base

    return getattr(base.scaled_dot_product_attention, "mlx_lm_original", base.scaled_dot_product_attention)


def scaled_dot_product_attention(
    queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, with kvshelf's latent keys attended on their planes."""
    if isinstance(keys, LatentKeys):
        if sinks is not None:
            raise InvalidCacheState("kvshelf's latent attention on encoded planes does not take attention sinks")
        return keys.attend(queries, scale, mask)
    placeholder = getattr(cache, "attend_latent_placeholder", None)  # a DSA layer's decode step on the planes
    if placeholder is not None:
        out = placeholder(queries, keys, scale, mask)
        if out is not None:
            if sinks is not None:
                raise InvalidCacheState("kvshelf's latent attention on encoded planes does not take attention sinks")
            return out
    return _mlx_lm_sdpa()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install() -> None:
    """Route mlx-lm's model modules' ``scaled_dot_product_attention`` through the function above (idempotent)."""
    from mlx_lm.models import base

    if base.scaled_dot_product_attention is scaled_dot_product_attention:
        return  # installed: model modules imported since take base's name, which is this function
    original = _mlx_lm_sdpa()
    if getattr(scaled_dot_product_attention, "mlx_lm_original", None) is None:
        scaled_dot_product_attention.mlx_lm_original = original  # type: ignore[attr-defined]
    for name, module in list(sys.modules.items()):
        if (name == "mlx_lm.models.base" or name.startswith("mlx_lm.models.")) and module is not None:
            if getattr(module, "scaled_dot_product_attention", None) is original:
                module.scaled_dot_product_attention = scaled_dot_product_attention
    base.scaled_dot_product_attention = scaled_dot_product_attention


__all__ = ["LatentKeys", "install", "scaled_dot_product_attention"]
