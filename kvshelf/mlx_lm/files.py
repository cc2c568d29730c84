"""mlx-lm's prompt-cache files both ways: ``save_prompt_cache`` files into a store, store sessions out as files
``load_prompt_cache`` reads.

mlx-lm's file (0.32.x) is a safetensors file: tensors are the flattened per-layer ``state`` trees, the metadata is
the flattened ``[user metadata, class names, scalar table]``. Files of mlx-lm 0.31 (``[meta_state, user metadata,
class names]``) are read too, into the same caches (``legacy_prompt_cache.py``); files are always written as 0.32's.
A file carries no tokens, no identity and no checksum.
Reading one here checks everything before anything is trusted, and nothing reaches a store until it all passed:
the safetensors framing (header length, JSON table, every tensor inside the data: a truncated file is
``CorruptData``), the metadata layout and the class names (only mlx-lm's cache classes; a missing or foreign class is
``IncompatibleFormat``), checksums when the file has them (files written here do), the rebuild through each class's
own ``from_state``, and finally the kvshelf codecs' validation of every rebuilt cache.

Files written here add, as plain string metadata mlx-lm passes through untouched, ``kvshelf_tokens`` (JSON token
ids), ``kvshelf_identity`` (JSON model id, config fingerprint, tokenizer hash, namespace), ``kvshelf_checksums``
(JSON: tensor name -> xxh3-128) and ``model`` (the model id, which ``mlx_lm.generate --prompt-cache-file`` checks).
Metadata keys must not contain dots: mlx-lm's loader would nest them.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as lm_cache

from ..codecs import default_provider, dtypes
from ..codecs.checksum import checksum
from ..codecs.snapshot_args import export_path
from ..codecs.snapshot_file import fsync_dir, normalize_tokens
from ..errors import CorruptData, IncompatibleFormat, InvalidCacheState, KvShelfError, file_error
from .legacy_prompt_cache import is_legacy, legacy_layout, legacy_state

CLASSES = ("KVCache", "ConcatenateKVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache", "ArraysCache",
           "CacheList")
TOKENS_KEY, IDENTITY_KEY, CHECKSUMS_KEY = "kvshelf_tokens", "kvshelf_identity", "kvshelf_checksums"
OWN_KEYS = (TOKENS_KEY, IDENTITY_KEY, CHECKSUMS_KEY)
MAX_HEADER = 256 * 2**20
_CODES = {dtypes.safetensors_code(name): name for name in dtypes.DTYPE_NAMES}


@dataclass
class PromptCacheFile:
    """What an mlx-lm prompt-cache file holds: caches (mlx-lm classes), tokens (None when the file has none and
    none were given), the user metadata (without kvshelf's own keys) and the identity kvshelf wrote, if any."""

    caches: list[Any]
    tokens: list[int] | None
    metadata: dict[str, str]
    identity: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# reading


def _table(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The safetensors tensor table and metadata, every tensor checked to lie inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise CorruptData(f"{path}: truncated ({size} bytes; a safetensors file starts with its header length)")
            length = int.from_bytes(prefix, "little")
            if length > MAX_HEADER or length > size - 8:
                raise CorruptData(f"{path}: header length {length} does not fit in a file of {size} bytes")
            raw = handle.read(length)
    except OSError as exc:
        raise CorruptData(f"{path}: cannot be read: {exc}") from exc
    try:
        table = msgspec.json.decode(raw)
        if not isinstance(table, dict):
            raise ValueError("the header is not a JSON object")
        metadata = table.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("__metadata__ is not a string map")
    except (msgspec.DecodeError, ValueError, UnicodeDecodeError) as exc:
        raise CorruptData(f"{path}: safetensors header does not decode ({exc})") from None
    data = size - 8 - length
    for name, info in table.items():
        try:
            dtype, shape, (begin, end) = _CODES[info["dtype"]], info["shape"], info["data_offsets"]
            nbytes = dtypes.nbytes_of(dtype, shape)
        except (KeyError, TypeError, ValueError):
            raise CorruptData(f"{path}: tensor {name!r} has a malformed entry {info!r}") from None
        if not 0 <= begin <= end or end - begin != nbytes:
            raise CorruptData(f"{path}: tensor {name!r} spans [{begin}, {end}), its shape needs {nbytes} bytes")
        if end > data:
            raise CorruptData(f"{path}: truncated file (tensor {name!r} ends at {end}, the data has {data} bytes)")
    return table, metadata


def is_prompt_cache_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like an mlx-lm prompt-cache file (class names and scalar table in its metadata)."""
    try:
        _, metadata = _table(Path(path))
    except KvShelfError:
        return False
    return "kvshelf.header" not in metadata and (("1.0" in metadata and "2.0" in metadata) or is_legacy(metadata))


def _layout(path: Path, metadata: dict[str, str]) -> tuple[dict[str, str], list[str], list[tuple[str, str]]]:
    """(user metadata, class per layer, scalar table) of mlx-lm 0.32's metadata layout."""
    if metadata.get("2.0") != "":
        raise IncompatibleFormat(f"{path}: not an mlx-lm 0.32 prompt-cache file (no scalar table '2.0' in its "
                                 "metadata, nor 0.31's class names; other layouts are not read)")
    user, classes, scalars = {}, {}, {}
    for key, value in metadata.items():
        head, _, rest = key.partition(".")
        if head == "0" and rest:
            user[rest] = value
        elif head == "1" and rest.isdigit():
            classes[int(rest)] = value
        elif head == "2" and rest != "0":
            n, _, part = rest.partition(".")
            if not n.isdigit() or part not in ("0", "1"):
                raise CorruptData(f"{path}: metadata key {key!r} is not part of mlx-lm's scalar table")
            scalars.setdefault(int(n), {})[part] = value
        elif key != "2.0":
            raise CorruptData(f"{path}: metadata key {key!r} is not part of mlx-lm's layout")
    if not classes:
        raise IncompatibleFormat(f"{path}: the file names no cache class (metadata '1.<layer>' is missing)")
    if sorted(classes) != list(range(len(classes))):
        raise IncompatibleFormat(f"{path}: cache classes are missing for layers "
                                 f"{sorted(set(range(max(classes) + 1)) - set(classes))}")
    table = []
    for n in sorted(scalars):
        entry = scalars[n]
        if set(entry) != {"0", "1"} or entry["1"] not in ("scalar", "string", "none"):
            raise CorruptData(f"{path}: scalar table row {n} is malformed ({entry!r})")
        table.append((entry["0"], entry["1"]))
    return user, [classes[i] for i in range(len(classes))], table


def _check_class(path: Path, name: Any, where: str) -> None:
    if name not in CLASSES:
        raise IncompatibleFormat(f"{path}: {where} is {name!r}, not one of mlx-lm's cache classes kvshelf reads "
                                 f"({', '.join(CLASSES)})")


def _rebuild(path: Path, name: str, state: Any, where: str) -> Any:
    """The cache of class ``name`` from its state, through mlx-lm's own ``from_state`` (CacheList children too)."""
    _check_class(path, name, where)
    try:
        if name == "CacheList":
            if not isinstance(state, list) or not state:
                raise ValueError("a CacheList state is a non-empty list of (state, class name) pairs")
            children = []
            for k, pair in enumerate(state):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise ValueError(f"child {k} is not a (state, class name) pair")
                children.append(_rebuild(path, pair[1], pair[0], f"{where} child {k}"))
            return lm_cache.CacheList(*children)
        return getattr(lm_cache, name).from_state(state)
    except KvShelfError:
        raise
    except Exception as exc:
        raise CorruptData(f"{path}: {where} ({name}) cannot be rebuilt from its state: {type(exc).__name__}: {exc}"
                          ) from None


def _json(path: Path, metadata: dict[str, str], key: str) -> Any:
    if key not in metadata:
        return None
    try:
        return json.loads(metadata[key])
    except ValueError:
        raise CorruptData(f"{path}: metadata {key!r} is not JSON") from None


def read_prompt_cache(path: str | os.PathLike[str], *, tokens: Any = None, verify: bool = True) -> PromptCacheFile:
    """Read and fully check an mlx-lm ``save_prompt_cache`` file (see the module docstring).

    ``tokens``: the token ids the caches encode, needed when the file carries none (files kvshelf wrote carry
    them); given for a file that has them, they must agree. Every cache must hold exactly that many positions.
    """
    path = Path(path)
    table, metadata = _table(path)
    legacy = is_legacy(metadata)
    if legacy:  # mlx-lm 0.31: meta_state strings instead of a scalar table
        user, classes, metas = legacy_layout(path, metadata)
        scalars: list[tuple[str, str]] = []
    else:
        user, classes, scalars = _layout(path, metadata)
    for i, name in enumerate(classes):
        _check_class(path, name, f"layer {i}'s class")
    stored = _json(path, user, TOKENS_KEY)
    if stored is not None:
        stored = normalize_tokens(stored) if isinstance(stored, list) else None
        if stored is None:
            raise CorruptData(f"{path}: metadata {TOKENS_KEY!r} is not a list of token ids")
    if tokens is not None:
        tokens = normalize_tokens(tokens)
        if stored is not None and stored != tokens:
            raise InvalidCacheState(f"{path}: the file's {len(stored)} tokens differ from the {len(tokens)} given")
    tokens = tokens if tokens is not None else stored
    identity = _json(path, user, IDENTITY_KEY) or {}
    sums = _json(path, user, CHECKSUMS_KEY) or {}
    if not isinstance(identity, dict) or not isinstance(sums, dict):
        raise CorruptData(f"{path}: kvshelf metadata is malformed")
    try:
        arrays = mx.load(str(path), format="safetensors")  # by content: a name without the suffix reads too
    except Exception as exc:
        raise CorruptData(f"{path}: tensors cannot be read: {exc}") from None
    if set(arrays) != set(table):
        raise CorruptData(f"{path}: the tensor table and the loaded tensors differ")
    if verify:
        for name, expected in sums.items():
            if name not in arrays:
                raise CorruptData(f"{path}: checksummed tensor {name!r} is missing")
            if checksum(arrays[name]) != expected:
                raise CorruptData(f"{path}: tensor {name!r} checksum mismatch (stored {expected})")
    for tensor_path, kind in scalars:
        if tensor_path not in arrays:
            raise CorruptData(f"{path}: scalar table names tensor {tensor_path!r}, which is not in the file")
        array = arrays[tensor_path]
        try:
            arrays[tensor_path] = (array.item() if kind == "scalar" else None if kind == "none"
                                   else "".join(chr(c) for c in array.tolist()))
        except (ValueError, TypeError, OverflowError):
            raise CorruptData(f"{path}: scalar {tensor_path!r} ({kind}) does not decode") from None
    try:
        states = tree_unflatten(list(arrays.items())) if arrays else []
    except Exception as exc:
        raise CorruptData(f"{path}: tensor names do not form mlx-lm's per-layer states ({exc})") from None
    if not isinstance(states, list) or len(states) != len(classes):
        found = len(states) if isinstance(states, list) else 0
        raise IncompatibleFormat(f"{path}: {len(classes)} cache classes but {found} layer states")
    if legacy:
        states = [legacy_state(path, name, state, meta, f"layer {i}")
                  for i, (name, state, meta) in enumerate(zip(classes, states, metas))]
    caches = [_rebuild(path, name, state, f"layer {i}") for i, (name, state) in enumerate(zip(classes, states))]
    for i, cache in enumerate(caches):
        try:
            entry, _ = default_provider.snapshot(cache, checksums=False, length=len(tokens) if tokens else None)
        except KvShelfError as exc:
            if tokens is None and isinstance(exc, InvalidCacheState) and "counts no positions" in str(exc):
                raise InvalidCacheState(f"{path}: the file carries no tokens; give the token ids it encodes") from None
            raise CorruptData(f"{path}: layer {i} ({classes[i]}) is inconsistent: {exc}") from None
        if tokens is not None and entry.offset != len(tokens):
            raise InvalidCacheState(f"{path}: layer {i} holds {entry.offset} positions but {len(tokens)} tokens")
    own = {k: v for k, v in user.items() if k not in OWN_KEYS}
    return PromptCacheFile(caches, tokens, own, {k: v for k, v in identity.items() if isinstance(v, str)})


# ----------------------------------------------------------------------------------------------------------------
# writing


# kvshelf's key/value legos whose entries share their slot layout with an mlx-lm class's codec
_AS_MLX_LM = {"kv": "mlx-lm.kv", "qkv": "mlx-lm.qkv", "rotating": "mlx-lm.rotating", "arrays": "mlx-lm.arrays"}


def as_mlx_lm(cache: Any, length: int) -> Any:
    """``cache`` as an mlx-lm cache object: mlx-lm's own classes as they are, kvshelf's serial ``KVCache``,
    ``QuantizedKVCache``, ``RotatingKVCache`` and ``ArraysCache`` legos through their shared slot layout (the same
    tensors, relabelled); a ``CacheList`` child by child (glm_moe_dsa's holds kvshelf's latent legos, which have no
    mlx-lm class: refused); anything else mlx-lm cannot load is an ``InvalidCacheState``."""
    name = type(cache).__name__
    if type(cache) is lm_cache.CacheList:
        children = []
        for k, child in enumerate(cache.caches):
            try:
                children.append(as_mlx_lm(child, length))
            except InvalidCacheState as exc:
                raise InvalidCacheState(f"a CacheList's child {k}: {exc}") from None
        return lm_cache.CacheList(*children)
    if name in CLASSES and type(cache) is getattr(lm_cache, name):
        return cache
    entry, arrays = default_provider.snapshot(cache, checksums=False, length=length)
    kind = _AS_MLX_LM.get(entry.kind)
    if kind is None:
        raise InvalidCacheState(f"a {type(cache).__module__}.{name} ({entry.kind}) has no mlx-lm class that "
                                "load_prompt_cache could rebuild; keep it in a store or a kvshelf snapshot file")
    extra = dict(entry.extra)
    if kind in ("mlx-lm.kv", "mlx-lm.qkv") and extra:
        extra["capacity"] = entry.offset
    relabelled = msgspec.structs.replace(entry, kind=kind, extra=extra)
    return default_provider.for_entry(kind).load(relabelled, arrays, verify=False)


def write_prompt_cache(path: str | os.PathLike[str], tokens: Any, caches: list[Any], *,
                       metadata: dict[str, str] | None = None, identity: Any = None) -> Path:
    """Write ``caches`` (serial; mlx-lm classes or kvshelf's key/value legos, see ``as_mlx_lm``) as a file
    mlx-lm's ``load_prompt_cache`` loads, atomically (0600).

    The file also carries the tokens, the identity (an ``Identity``, a mapping or None) and a checksum per tensor
    (module docstring), so reading it back here is checked end to end. ``path`` without a suffix gets
    ``.safetensors`` (mlx-lm loads nothing else; another suffix is refused: ``export_path``). Before the file takes
    its name it is loaded by mlx-lm's own ``load_prompt_cache`` and every tensor compared with what was written
    (``_read_back``): a file mlx-lm cannot load is never left behind. Returns the path written.
    """
    target = export_path(path, mlx_lm=True)
    tokens = normalize_tokens(tokens)
    caches = [as_mlx_lm(cache, len(tokens)) for cache in caches]
    for i, cache in enumerate(caches):
        entry, _ = default_provider.snapshot(cache, checksums=False, length=len(tokens))
        if entry.offset != len(tokens):
            raise InvalidCacheState(f"layer {i} holds {entry.offset} positions but {len(tokens)} tokens were given")
    user = dict(metadata or {})
    for key, value in user.items():
        if not isinstance(key, str) or not isinstance(value, str) or "." in key or key in OWN_KEYS:
            raise InvalidCacheState(f"metadata {key!r}: keys and values are strings, keys without dots and not "
                                    f"one of {OWN_KEYS}")
    ident = _identity_map(identity)
    if ident.get("model_id"):
        user.setdefault("model", ident["model_id"])
    user[TOKENS_KEY] = json.dumps(tokens)
    user[IDENTITY_KEY] = json.dumps(ident)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp.safetensors", dir=directory)
    except OSError as exc:
        raise file_error(exc, f"cannot write {target}") from None
    os.close(fd)
    try:
        state = tree_flatten([c.state for c in caches])
        sums = {name: checksum(a) for name, a in state if isinstance(a, mx.array)}
        user[CHECKSUMS_KEY] = json.dumps(sums)
        lm_cache.save_prompt_cache(tmp, caches, user)
        os.chmod(tmp, 0o600)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        _read_back(Path(tmp), target, [type(c).__name__ for c in caches], sums)
        os.replace(tmp, target)
        fsync_dir(directory)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _read_back(tmp: Path, target: Path, classes: list[str], sums: dict[str, str]) -> None:
    """mlx-lm's ``load_prompt_cache`` on the written file: the same classes, every tensor's checksum as written.
    ``CorruptData`` naming ``target`` otherwise (the caller removes the file)."""
    try:
        loaded = lm_cache.load_prompt_cache(str(tmp))
        got = [type(c).__name__ for c in loaded]
        if got != classes:
            raise ValueError(f"classes {got} instead of {classes}")
        for name, a in tree_flatten([c.state for c in loaded]):
            if isinstance(a, mx.array) and name in sums and checksum(a) != sums[name]:
                raise ValueError(f"tensor {name!r} differs from what was written")
    except Exception as exc:
        raise CorruptData(f"{target}: mlx-lm's load_prompt_cache cannot load the file written "
                          f"({type(exc).__name__}: {exc}), so it was not kept") from None


def _identity_map(identity: Any) -> dict[str, str]:
    fields = ("model_id", "config_fingerprint", "tokenizer_hash", "namespace")
    if identity is None:
        return {}
    if isinstance(identity, dict):
        return {f: identity[f] for f in fields if isinstance(identity.get(f), str)}
    return {f: getattr(identity, f) for f in fields if isinstance(getattr(identity, f, None), str)}


# ----------------------------------------------------------------------------------------------------------------
# store <-> file


def import_prompt_cache(store: Any, path: str | os.PathLike[str], session_id: str | None = None, *,
                        tokens: Any = None, namespace: str = "") -> Any:
    """Check ``path`` completely (``read_prompt_cache``), then save its caches and tokens as ``session_id``
    (default: the file name without ``.safetensors``) in ``store``. Returns the store's ``SnapshotInfo``.

    A file without tokens needs ``tokens``; a bad file raises a ``KvShelfError`` and writes nothing.
    """
    got = read_prompt_cache(path, tokens=tokens)
    if got.tokens is None:
        raise InvalidCacheState(f"{path}: the file carries no tokens; pass tokens=[...] (the ids its caches encode)")
    name = Path(path).name
    session = session_id or (name[: -len(".safetensors")] if name.endswith(".safetensors") else Path(path).stem)
    return store.save(session, got.tokens, got.caches, namespace=namespace)


def export_prompt_cache(store: Any, session_id: str, path: str | os.PathLike[str], *, namespace: str = "",
                        metadata: dict[str, str] | None = None) -> Path:
    """Write the session's latest snapshot (mlx-lm caches) as a file mlx-lm's ``load_prompt_cache`` loads."""
    restored = store.restore(session_id, namespace=namespace)
    ident = _identity_map(getattr(store, "identity", None))
    ident["namespace"] = namespace
    return write_prompt_cache(path, restored.tokens, restored.caches, metadata=metadata, identity=ident)


__all__ = ["PromptCacheFile", "as_mlx_lm", "export_prompt_cache", "import_prompt_cache", "is_prompt_cache_file",
           "read_prompt_cache", "write_prompt_cache"]
