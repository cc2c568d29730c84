"""``make_prompt_cache``: mlx-lm's prompt cache with kvshelf's latent legos in every MLA layer.

mlx-lm keeps the latent of deepseek_v3 / glm4_moe_lite / glm_moe_dsa (and other absorbed-MLA models) in plain
``KVCache``s. This builds mlx-lm's own cache list for the model and replaces each MLA layer's cache with a face
(``MLALatentCache``, or ``DSALatentCache`` for sparse-attention layers) over the lego the scheme names —
``MLACache`` (float32), an f32-first ``EncodedLatentCache`` or a ``PagedLatentCache`` — so the model's attention
code runs unchanged while the store persists the compressed latent. Every other layer keeps mlx-lm's cache.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from ...errors import InvalidCacheState
from ...latent_legos.latent.geometry import LatentGeometry
from ...latent_legos.latent.scheme import KvScheme, composed_latent_cache
from .attention import install as install_latent_attention
from .dsa import DSALatentCache
from .faces import MLALatentCache


def mla_attention(layer: Any) -> Any | None:
    """The layer's absorbed-MLA attention module (latent + RoPE key cached, ``embed_q`` absorption), else None."""
    attn = getattr(layer, "self_attn", None)
    needed = ("kv_lora_rank", "qk_rope_head_dim", "kv_a_proj_with_mqa", "embed_q", "unembed_out")
    return attn if attn is not None and all(hasattr(attn, a) for a in needed) else None


def _geometry(attn: Any, max_kv_size: int | None) -> LatentGeometry:
    indexer = getattr(attn, "indexer", None)
    return LatentGeometry(
        kv_lora_rank=int(attn.kv_lora_rank), rope_head_dim=int(attn.qk_rope_head_dim),
        index_head_dim=None if indexer is None else int(indexer.head_dim), max_tokens=max_kv_size,
    )


def make_prompt_cache(
    model: Any,
    scheme: KvScheme | None = None,
    paged_block_size: int | None = None,
    max_kv_size: int | None = None,
) -> list[Any]:
    """mlx-lm's prompt cache for ``model`` with kvshelf's latent legos in its MLA layers.

    ``scheme`` (default ``KvScheme.bf16()``: float32 latents, bit-identical to mlx-lm's caches) names each MLA
    layer's storage (cache index = layer index for ``KvScheme.affine_layers``); ``paged_block_size`` pages it.
    ``max_kv_size`` caps an MLA layer at that many positions (an append past it raises ``CacheRangeError``: a latent
    lego has no sliding window, where mlx-lm would give a model without ``make_cache`` a ``RotatingKVCache``) and
    reaches mlx-lm's ``make_prompt_cache`` for the other layers (mlx-lm ignores it for models that build their own
    caches). A model without MLA layers gets exactly mlx-lm's caches.
    """
    scheme = KvScheme.bf16() if scheme is None else scheme
    if not isinstance(scheme, KvScheme):
        raise InvalidCacheState(f"scheme must be a KvScheme (got {type(scheme).__name__})")
    caches = mlx_make_prompt_cache(model, max_kv_size=max_kv_size)
    install_latent_attention()  # decode steps over encoded planes reach kvshelf's attention (latent_attention)
    layers = list(getattr(model, "layers", []))
    if len(layers) != len(caches):
        return caches  # not one cache per decoder layer: nothing here is known to be an MLA layer's cache
    out = []
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        attn = mla_attention(layer)
        if attn is None:
            out.append(cache)
            continue
        geometry = _geometry(attn, max_kv_size)
        lego = composed_latent_cache(scheme, paged_block_size, i, geometry)
        if geometry.has_index and type(cache) is CacheList and all(type(c) is KVCache for c in cache.caches):
            out.append(DSALatentCache(lego))
        elif not geometry.has_index and (type(cache) is KVCache or (max_kv_size and type(cache) is RotatingKVCache)):
            out.append(MLALatentCache(lego))
        else:
            raise InvalidCacheState(
                f"layer {i}: mlx-lm builds a {type(cache).__name__} for this MLA layer, which kvshelf's latent "
                "adapters do not know; use mlx-lm's make_prompt_cache for this model"
            )
    return out


__all__ = ["DSALatentCache", "MLALatentCache", "make_prompt_cache", "mla_attention"]
