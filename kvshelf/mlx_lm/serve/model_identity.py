"""The store identity of a served model: what its weights are, not where they are.

Why: a prompt cache is only valid for the exact model that computed it. mlx-lm's server keys its RAM cache by the
path strings alone; a persistent, shared store needs more, since a directory can be re-converted, another process
may serve other weights under the same name, and a different tokenizer or chat template changes what token ids
mean. And a path is the wrong key twice over: the same weights copied to another directory, or mounted at another
path on a second host sharing the Redis tier, are the same model, while other weights of the same shapes written
where the old ones were are not.

What goes where (``kvshelf.Identity``):
- ``model_id``: ``weights:<xxh3-128>``, a content fingerprint of every weight file (``weights_fingerprint.py``;
  hashed once, then remembered in a sidecar in the store directory keyed by path, size, mtime, ctime and inode), or
  the name an operator asserts with ``--model-id`` (then nothing is hashed: the operator vouches that the name
  means those weights). An adapter appends ``+adapter:`` and its own weights' fingerprint.
- ``config_fingerprint``: sha256 over config.json (canonical JSON), each weight file's name + safetensors header,
  the adapter's config and headers, the draft model's fingerprint, the KV-cache settings that change what a cache
  holds (``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``) and the cache-format tag of every codec
  (``MlxCodec.format_tag``: a tag per layout, not the mlx/mlx-lm version string, so a patch release that keeps the
  layout keeps the store, and a layout change makes old snapshots another identity's).
- ``tokenizer_hash``: sha256 over the tokenizer files (tokenizer.json, tokenizer_config.json with its chat
  template, chat_template.jinja/json, special tokens, vocab/merges, generation_config.json) plus a template given
  on the command line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...errors import CorruptData, KvShelfError
from ...store.identity import Identity
from .weights_fingerprint import FingerprintSidecar, weights_fingerprint

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "tiktoken.model", "generation_config.json",
)
_HUB_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[^/]+)/?$")


class ModelFilesError(KvShelfError, FileNotFoundError):
    """The model directory lacks what an identity is computed from (config.json), or cannot be found offline."""


def safetensors_header(path: str | os.PathLike) -> bytes:
    """The raw JSON header of a safetensors file: the 8-byte little-endian length, then that many bytes. Nothing
    else of the file is read."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CorruptData(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CorruptData(f"{path}: safetensors header length {n} exceeds {MAX_HEADER_BYTES}")
        raw = f.read(n)
    if len(raw) != n:
        raise CorruptData(f"{path}: safetensors header truncated ({len(raw)} of {n} bytes)")
    try:
        json.loads(raw)
    except ValueError as exc:
        raise CorruptData(f"{path}: safetensors header is not JSON: {exc}") from None
    return raw


def resolve_model_dir(path_or_repo: str | os.PathLike) -> Path:
    """A local directory as is; a hub repo id through the local Hugging Face cache only (never a download)."""
    p = Path(path_or_repo).expanduser()
    if p.is_dir():
        return p.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_repo), local_files_only=True)).resolve()
    except Exception as exc:  # noqa: BLE001 - any hub failure means "not available offline"
        raise ModelFilesError(f"model {str(path_or_repo)!r} is neither a directory nor in the local Hugging Face "
                              f"cache ({type(exc).__name__}: {exc})") from None


def model_id_of(path_or_repo: str | os.PathLike, resolved: Path) -> str:
    """``org/name@revision`` for a hub snapshot (wherever the cache lives), else the directory's real path."""
    m = _HUB_SNAPSHOT.search(resolved.as_posix())
    if m:
        return f"{m['org']}/{m['name']}@{m['rev']}"
    return str(resolved)


def _hash_files(h: Any, root: Path, names: Iterable[str]) -> None:
    for name in names:
        f = root / name
        if f.is_file():
            data = f.read_bytes()
            h.update(struct.pack("<Q", len(name)) + name.encode() + struct.pack("<Q", len(data)) + data)


def _weights_part(h: Any, root: Path, pattern: str) -> int:
    files = sorted(root.glob(pattern))
    for f in files:
        header = safetensors_header(f)
        h.update(struct.pack("<Q", len(f.name)) + f.name.encode() + struct.pack("<Q", len(header)) + header)
    return len(files)


def cache_format_tags() -> list[str]:
    """``kind=tag`` of every codec this mlx-lm plugin registers, sorted: the cache layouts a snapshot may use."""
    from ..plugin import codecs

    return sorted(f"{c.kind}={getattr(c, 'format_tag', 1)}" for c in codecs())


def config_fingerprint(model_dir: Path, *, adapter_dir: Path | None = None, draft_dir: Path | None = None,
                       cache_settings: dict[str, Any] | None = None) -> str:
    """sha256 (hex) of config.json, the weight headers, the adapter, the draft model, the cache settings and the
    codecs' cache-format tags."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelFilesError(f"{model_dir} has no config.json: not a model directory")
    h = hashlib.sha256(b"kvshelf-model-fingerprint-v1\0")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise CorruptData(f"{config_file}: not JSON: {exc}") from None
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0weights\0")
    _weights_part(h, model_dir, "*.safetensors")
    if adapter_dir is not None:
        h.update(b"\0adapter\0")
        _hash_files(h, adapter_dir, ["adapter_config.json"])
        _weights_part(h, adapter_dir, "*.safetensors")
    if draft_dir is not None:
        h.update(b"\0draft\0" + config_fingerprint(draft_dir).encode())
    if cache_settings:
        h.update(b"\0cache\0" + json.dumps(cache_settings, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0formats\0" + json.dumps(cache_format_tags(), separators=(",", ":")).encode())
    return h.hexdigest()


def tokenizer_hash(model_dir: Path, chat_template: str | None = None) -> str:
    """sha256 (hex) of the tokenizer files, chat template included, plus a template given on the command line."""
    h = hashlib.sha256(b"kvshelf-tokenizer-v1\0")
    _hash_files(h, model_dir, TOKENIZER_FILES)
    if chat_template:
        h.update(b"\0override\0" + chat_template.encode())
    return h.hexdigest()


def model_identity(model: str | os.PathLike, *, adapter_path: str | os.PathLike | None = None,
                   draft_model: str | os.PathLike | None = None, chat_template: str | None = None,
                   cache_settings: dict[str, Any] | None = None, model_id: str | None = None,
                   fingerprints: FingerprintSidecar | str | os.PathLike | None = None) -> Identity:
    """The ``Identity`` a server serving ``model`` (with that adapter, draft model, template and cache settings)
    stores its prompt caches under. ``model_id`` asserts the model's name instead of hashing its weights;
    ``fingerprints`` is the sidecar (or a store directory holding it) that remembers weight digests across starts
    (``None``: hash every time)."""
    sidecar = fingerprints if isinstance(fingerprints, FingerprintSidecar) else FingerprintSidecar.in_store(fingerprints)
    model_dir = resolve_model_dir(model)
    adapter_dir = resolve_model_dir(adapter_path) if adapter_path is not None else None
    draft_dir = resolve_model_dir(draft_model) if draft_model is not None else None
    fingerprint = config_fingerprint(model_dir, adapter_dir=adapter_dir, draft_dir=draft_dir,
                                     cache_settings=cache_settings)  # first: a directory without config.json says so
    name = model_id if model_id else "weights:" + weights_fingerprint(model_dir, sidecar)
    if adapter_dir is not None:
        name += "+adapter:" + weights_fingerprint(adapter_dir, sidecar)
    sidecar.save()
    return Identity(name, config_fingerprint=fingerprint, tokenizer_hash=tokenizer_hash(model_dir, chat_template))


__all__ = ["ModelFilesError", "cache_format_tags", "config_fingerprint", "model_id_of", "model_identity",
           "resolve_model_dir", "safetensors_header", "tokenizer_hash"]
