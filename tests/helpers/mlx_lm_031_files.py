"""mlx-lm 0.31's ``save_prompt_cache``, reproduced from its documented layout, for the import tests.

mlx-lm 0.32.2 can no longer write (or load) these files, so the tests write them here from live 0.32 caches: each
layer's state as 0.31's classes returned it (key/value buffers cut to the offset, no scalars among the tensors), its
``meta_state`` as decimal strings (``""`` for a class without scalars), and the metadata as the flattened
``[per-layer meta_state, user metadata, class names]``.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten


def _cut(x, offset):
    if isinstance(x, (list, tuple)):
        return tuple(_cut(a, offset) for a in x)
    return x if x.shape[2] == offset else x[..., :offset, :]


def old_state(c) -> tuple[object, object]:
    """(state, meta_state) as mlx-lm 0.31 returned them for the 0.32 cache ``c``."""
    name = type(c).__name__
    if name == "ConcatenateKVCache":
        return (c.keys, c.values), ""
    if name == "KVCache":
        return (_cut(c.keys, c.offset), _cut(c.values, c.offset)), ""
    if name == "QuantizedKVCache":
        return (_cut(c.keys, c.offset), _cut(c.values, c.offset)), tuple(map(str, (c.offset, c.group_size, c.bits)))
    if name == "RotatingKVCache":
        kv = (c.keys, c.values) if c.offset >= c.keys.shape[2] else (_cut(c.keys, c.offset), _cut(c.values, c.offset))
        return kv, tuple(map(str, (c.keep, c.max_size, c.offset, c._idx)))
    if name == "ChunkedKVCache":
        return (_cut(c.keys, c.offset), _cut(c.values, c.offset)), tuple(map(str, (c.chunk_size, c.start_position)))
    if name == "ArraysCache":
        return list(c.cache), ""
    if name == "CacheList":
        pairs = [old_state(child) for child in c.caches]
        return [s for s, _ in pairs], ([type(child).__name__ for child in c.caches], [m for _, m in pairs])
    raise TypeError(f"mlx-lm 0.31 had no {name}")


def save_prompt_cache_031(path, caches, metadata: dict[str, str] | None = None) -> None:
    pairs = [old_state(c) for c in caches]
    arrays = dict(tree_flatten([s for s, _ in pairs]))
    meta = dict(tree_flatten([[m for _, m in pairs], dict(metadata or {}), [type(c).__name__ for c in caches]]))
    assert all(isinstance(a, mx.array) for a in arrays.values())
    mx.save_safetensors(str(path), arrays, meta)


__all__ = ["old_state", "save_prompt_cache_031"]
