"""kvshelf.latent_legos: the MLX cache library and its row contract. No I/O.

The latent (compressed MLA) legos live here; the key/value legos that keep mlx-lm's calling convention live in
:mod:`kvshelf.latent_legos.kv` and are re-exported. ``SyntheticMLAModel``, the encoded legos and the key/value legos
load on first use, so importing the package stays cheap.
"""

from __future__ import annotations

from importlib import import_module

from .contracts import (
    BatchableCache,
    Cache,
    LatentAttentionCache,
    LatentAttentionState,
    PaddedPrefillCache,
    PrefillPadding,
    SpeculativeTransaction,
)
from .formats import AffineFormat, TurboFormat, format_key
from .latent.geometry import LatentGeometry
from .latent.mla import MLACache, MLARowState
from .latent.pages import LatentPages
from .latent.paged import PagedLatentCache

_LAZY = {
    "EncodedLatentCache": ".latent.encoded",
    "EncodedRowState": ".latent.encoded",
    "KvScheme": ".latent.scheme",
    "latent_format_of": ".latent.scheme",
    "composed_latent_cache": ".latent.scheme",
    "SyntheticMLAModel": "kvshelf.testing.synthetic_model",
    "KVCache": ".kv",
    "QuantizedKVCache": ".kv",
    "TurboQuantKVCache": ".kv",
    "RotatingKVCache": ".kv",
    "ArraysCache": ".kv",
    "KvRowState": ".kv",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(
    [
        "AffineFormat",
        "BatchableCache",
        "Cache",
        "LatentAttentionCache",
        "LatentAttentionState",
        "LatentGeometry",
        "LatentPages",
        "MLACache",
        "MLARowState",
        "PaddedPrefillCache",
        "PagedLatentCache",
        "PrefillPadding",
        "SpeculativeTransaction",
        "TurboFormat",
        "format_key",
        *_LAZY,
    ]
)
