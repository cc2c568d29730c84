"""Key/value legos: mlx-lm's cache classes (same calling convention) with kvshelf's row contract.

``KVCache``, ``QuantizedKVCache`` and ``TurboQuantKVCache`` share right-justified rows over planes with positions
on axis 2 (mlx-lm's ``BatchKVCache`` geometry); ``RotatingKVCache`` is a ring (rows batch only when laid out alike);
``ArraysCache`` holds recurrent state (never trimmable). ``model_face`` is what mlx-lm's model and batching code see:
per-row ``offset`` positions for a batch, and ``BatchGenerator``'s ``merge``/``extend``/``filter``/``extract``/
``prepare``/``finalize``.
"""

from .arrays import ArraysCache
from .masks import attention_mask, causal_mask
from .plain import KVCache
from .quantized import QuantizedKVCache
from .rotating import RotatingKVCache
from .token_rows import STEP, KvRowState, TokenRows
from .turbo import TurboQuantKVCache

__all__ = [
    "STEP",
    "ArraysCache",
    "KVCache",
    "KvRowState",
    "QuantizedKVCache",
    "RotatingKVCache",
    "TokenRows",
    "TurboQuantKVCache",
    "attention_mask",
    "causal_mask",
]
