"""The store identity of a served model, computed from its files without reading a single weight.

Why: a prompt cache is only valid for the exact model that computed it. mlx-lm's server keys its RAM cache by the
path strings alone; a persistent, shared store needs more, since a directory can be re-converted, another process
may serve other weights under the same name, and a different tokenizer or chat template changes what token ids
mean. Hashing the weights is out of the question (gigabytes at every start-up), so the fingerprint covers what
identifies them cheaply and exactly: ``config.json`` and every safetensors *header* (8-byte length + JSON: names,
dtypes, shapes, offsets, metadata). Same-shaped weights with other values have identical headers, so the model id
keeps the path: a local directory by its real path, a Hugging Face snapshot by ``repo@revision``.

What goes where (``kvshelf.Identity``):
- ``model_id``: ``org/name@revision`` for a hub snapshot, else the directory's real path, else the string given.
- ``config_fingerprint``: sha256 over config.json (canonical JSON), each weight file's name + header, the adapter's
  config and headers, the draft model's fingerprint, and the KV-cache settings that change what a cache holds
  (``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``), so quantized and full caches never mix.
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


def config_fingerprint(model_dir: Path, *, adapter_dir: Path | None = None, draft_dir: Path | None = None,
                       cache_settings: dict[str, Any] | None = None) -> str:
    """sha256 (hex) of config.json, the weight headers, the adapter, the draft model and the cache settings."""
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
                   cache_settings: dict[str, Any] | None = None) -> Identity:
    """The ``Identity`` a server serving ``model`` (with that adapter, draft model, template and cache settings)
    stores its prompt caches under."""
    model_dir = resolve_model_dir(model)
    adapter_dir = resolve_model_dir(adapter_path) if adapter_path is not None else None
    draft_dir = resolve_model_dir(draft_model) if draft_model is not None else None
    model_id = model_id_of(model, model_dir)
    if adapter_dir is not None:
        model_id += f"+adapter:{adapter_dir}"
    return Identity(model_id,
                    config_fingerprint=config_fingerprint(model_dir, adapter_dir=adapter_dir, draft_dir=draft_dir,
                                                          cache_settings=cache_settings),
                    tokenizer_hash=tokenizer_hash(model_dir, chat_template))


__all__ = ["ModelFilesError", "config_fingerprint", "model_id_of", "model_identity", "resolve_model_dir",
           "safetensors_header", "tokenizer_hash"]
