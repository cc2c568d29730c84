"""mlx-lm 0.31's prompt-cache file layout (``meta_state``), read into mlx-lm 0.32's cache states.

Why: files written by ``save_prompt_cache`` before mlx-lm's PR #1778 (0.31 and the 0.32.0 development line) are
still on users' disks, and mlx-lm 0.32 itself cannot load them (it fails with "too many values to unpack"). Their
layout is known (``/docs/API.md``, "mlx-lm prompt-cache files"):

- tensors: the flattened per-layer ``state``; a key/value class stored its buffers *cut to the offset* (no padding,
  no offset scalar), a quantized one its (data, scales, biases) triples, ``ArraysCache`` its list of arrays, a
  ``CacheList`` its children's states;
- metadata: the flattened ``[per-layer meta_state, user metadata, class names]``: ``0.<layer>[.<i>]`` the scalars as
  decimal strings (``""`` for a class without any), ``1.<key>`` the user metadata, ``2.<layer>`` the class names.

Each layer is turned into the state 0.32's ``from_state`` takes, exactly as 0.31's ``load_prompt_cache`` would
have set the object's fields (a key/value class's offset is its buffer's length; ``ChunkedKVCache`` included), the
buffers grown with zeros to mlx-lm's 256-position step as a 0.32 cache holds them; so the caches that come out, and
what a store keeps of them, are bit-identical to the 0.32 file of the same caches.
Nothing here trusts the file: a malformed scalar or a state of the wrong shape is ``CorruptData``, a class this
layout never had is ``IncompatibleFormat``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_unflatten

from ..errors import CorruptData, IncompatibleFormat

STEP = 256  # mlx-lm's KVCache / QuantizedKVCache / ChunkedKVCache buffer step
# class -> number of meta_state scalars 0.31 wrote (None: the class wrote "")
META_SCALARS = {"KVCache": None, "ConcatenateKVCache": None, "QuantizedKVCache": 3, "RotatingKVCache": 4,
                "ChunkedKVCache": 2, "ArraysCache": None, "CacheList": None}


def is_legacy(metadata: dict[str, str]) -> bool:
    """Whether the metadata has 0.31's layout: the class names under ``2.<layer>`` (0.32 puts an empty sentinel
    at ``2.0`` and the class names under ``1.<layer>``)."""
    return metadata.get("2.0") in META_SCALARS


def legacy_layout(path: Path, metadata: dict[str, str]) -> tuple[dict[str, str], list[str], list[Any]]:
    """(user metadata, class per layer, meta_state per layer) of a 0.31 file."""
    user, classes, info = {}, {}, []
    for key, value in metadata.items():
        head, _, rest = key.partition(".")
        if head == "1" and rest:
            user[rest] = value
        elif head == "2" and rest.isdigit():
            classes[int(rest)] = value
        elif head == "0" and rest:
            info.append((rest, value))
        else:
            raise CorruptData(f"{path}: metadata key {key!r} is not part of mlx-lm 0.31's layout")
    if sorted(classes) != list(range(len(classes))):
        raise IncompatibleFormat(f"{path}: cache classes are missing for layers "
                                 f"{sorted(set(range(max(classes) + 1)) - set(classes))}")
    try:
        metas = tree_unflatten(info) if info else []
    except Exception as exc:
        raise CorruptData(f"{path}: the meta_state entries do not form per-layer lists ({exc})") from None
    if not isinstance(metas, list) or len(metas) != len(classes):
        raise CorruptData(f"{path}: {len(classes)} cache classes but "
                          f"{len(metas) if isinstance(metas, list) else 0} meta_state entries")
    return user, [classes[i] for i in range(len(classes))], metas


def _ints(path: Path, meta: Any, n: int, where: str) -> list[int]:
    if not isinstance(meta, list) or len(meta) != n:
        raise CorruptData(f"{path}: {where}'s meta_state holds {meta!r}, not {n} scalars")
    try:
        return [int(v) for v in meta]
    except (TypeError, ValueError):
        raise CorruptData(f"{path}: {where}'s meta_state {meta!r} is not decimal integers") from None


def _pair(path: Path, state: Any, where: str, arity: int = 2) -> list:
    if not isinstance(state, list) or len(state) != arity:
        raise CorruptData(f"{path}: {where}'s state is not {arity} tensors (keys, values)")
    return state


def _length(path: Path, keys: Any, where: str) -> int:
    first = keys[0] if isinstance(keys, list) and keys else keys
    if not isinstance(first, mx.array) or first.ndim != 4:
        raise CorruptData(f"{path}: {where}'s keys are not a [B, H, S, D] tensor")
    return first.shape[2]


def _padded(x: mx.array, length: int) -> mx.array:
    """``x`` ([B, H, S, w]) grown with zeros to ``length`` positions (what 0.32's buffers hold past the offset)."""
    if x.shape[2] >= length:
        return x
    return mx.concatenate([x, mx.zeros((*x.shape[:2], length - x.shape[2], x.shape[3]), dtype=x.dtype)], axis=2)


def _stepped(keys: Any, values: Any, offset: int) -> tuple[Any, Any]:
    """Keys and values grown to the next multiple of mlx-lm's 256-position step, as a 0.32 cache filled with the
    same positions holds them (0.31 saved them cut to the offset). Zeros past the offset are never read."""
    length = -(-offset // STEP) * STEP
    if isinstance(keys, list):
        return [_padded(k, length) for k in keys], [_padded(v, length) for v in values]
    return _padded(keys, length), _padded(values, length)


def legacy_state(path: Path, name: str, state: Any, meta: Any, where: str) -> Any:
    """The 0.32 state (what ``from_state`` takes) of a layer 0.31 saved as ``state`` + ``meta``."""
    if name not in META_SCALARS:
        raise IncompatibleFormat(f"{path}: {where} is {name!r}, not one of the classes mlx-lm 0.31 wrote "
                                 f"({', '.join(META_SCALARS)})")
    if META_SCALARS[name] is None and meta not in ("", None) and name != "CacheList":
        raise CorruptData(f"{path}: {where} ({name}) has meta_state {meta!r}; 0.31 wrote none for this class")
    if name == "ConcatenateKVCache":
        return _pair(path, state, where)
    if name == "KVCache":
        keys, values = _pair(path, state, where)
        offset = _length(path, keys, where)
        return [*_stepped(keys, values, offset), offset]
    if name == "QuantizedKVCache":
        keys, values = _pair(path, state, where)
        offset, group_size, bits = _ints(path, meta, 3, where)
        if not isinstance(keys, list) or not isinstance(values, list) or len(keys) != 3 or len(values) != 3:
            raise CorruptData(f"{path}: {where}'s keys and values are not (data, scales, biases) triples")
        if _length(path, keys, where) != offset:
            raise CorruptData(f"{path}: {where} holds {_length(path, keys, where)} positions, its offset is {offset}")
        return [*_stepped(keys, values, offset), offset, group_size, bits]
    if name == "RotatingKVCache":
        keys, values = _pair(path, state, where)
        keep, max_size, offset, idx = _ints(path, meta, 4, where)
        return [keys, values, offset, keep, max_size, idx]
    if name == "ChunkedKVCache":
        keys, values = _pair(path, state, where)
        chunk_size, start_position = _ints(path, meta, 2, where)
        offset = _length(path, keys, where)
        return [*_stepped(keys, values, offset), offset, chunk_size, start_position]
    if name == "ArraysCache":
        if not isinstance(state, list) or not all(isinstance(a, mx.array) for a in state):
            raise CorruptData(f"{path}: {where}'s state is not a list of tensors")
        return [state, None, None]
    # CacheList: meta_state is ([child class names], [child meta_states])
    if not (isinstance(meta, list) and len(meta) == 2 and isinstance(meta[0], list)) or not isinstance(state, list):
        raise CorruptData(f"{path}: {where} (CacheList) has no (class names, meta states) pair")
    names, child_metas = meta[0], meta[1] if isinstance(meta[1], list) else []
    if len(names) != len(state):
        raise CorruptData(f"{path}: {where} (CacheList) names {len(names)} children but stores {len(state)}")
    child_metas = child_metas + [""] * (len(names) - len(child_metas))  # "" children flatten to nothing
    return [[legacy_state(path, n, s, m, f"{where} child {k}"), n]
            for k, (n, s, m) in enumerate(zip(names, state, child_metas))]


__all__ = ["META_SCALARS", "is_legacy", "legacy_layout", "legacy_state"]
