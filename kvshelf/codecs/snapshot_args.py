"""What the portable file's public calls accept: token sequences, identity fields, paths, and only regular files.

Split from ``snapshot_file`` so the format code reads as format code. Every refusal is a ``KvShelfError``: a wrong
type is ``WrongArgumentType``, a bad value ``InvalidCacheState``, an ``OSError`` on open ``FileAccessError`` /
``FileMissing``; tokens are bounded by the store's ``TOKEN_ID_LIMIT`` so every file written can be imported.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

from ..errors import (
    CorruptData,
    IdentityMismatch,
    InvalidCacheState,
    WrongArgumentType,
    file_error,
)
from .header import IDENTITY_FIELDS, MAX_IDENTITY_CHARS, TOKEN_ID_LIMIT, SnapshotHeader


def normalize_tokens(tokens: Any) -> list[int]:
    """A token sequence (list, tuple, 1-D numpy or MLX integer array) as a list of ints in ``[0, 2**31)``.

    The bound is the store's (``TOKEN_ID_LIMIT``), so every file written here can be imported. Arrays are checked
    with one vectorised pass."""
    if isinstance(tokens, mx.array):
        if tokens.ndim != 1 or not mx.issubdtype(tokens.dtype, mx.integer):
            raise InvalidCacheState(f"tokens must be a 1-D integer array (got {tokens.dtype} {list(tokens.shape)})")
        tokens = np.array(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidCacheState(f"tokens must be a 1-D integer array (got {tokens.dtype} {list(tokens.shape)})")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= TOKEN_ID_LIMIT):
            i = int(np.argmax((tokens < 0) | (tokens >= TOKEN_ID_LIMIT)))
            raise InvalidCacheState(f"tokens[{i}] must be a non-negative int token id below 2**31 (got {int(tokens[i])})")
        return tokens.tolist()
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence):
        raise WrongArgumentType(f"tokens must be a sequence of ints (got {type(tokens).__name__})")
    out = []
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise WrongArgumentType(f"tokens[{i}] must be an int token id (got {type(token).__name__} {token!r:.40})")
        if not 0 <= token < TOKEN_ID_LIMIT:
            raise InvalidCacheState(f"tokens[{i}] must be a non-negative int token id below 2**31 (got {int(token)})")
        out.append(int(token))
    return out


def snapshot_path(path: Any, what: str = "snapshot path") -> Path:
    """A filesystem path argument: str or os.PathLike (bytes paths and other types are refused), no NUL."""
    if not isinstance(path, (str, os.PathLike)):
        raise WrongArgumentType(f"{what} must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise WrongArgumentType(f"{what} must name a text path, got {type(text).__name__}")
    if not text or "\x00" in text:
        raise InvalidCacheState(f"{what} must be a non-empty path without NUL characters, got {text!r:.80}")
    return Path(text)


SUFFIX = ".safetensors"


def export_path(path: Any, *, mlx_lm: bool = False) -> Path:
    """Where an export writes: ``path``, with ``.safetensors`` added when its name has no suffix (``out`` ->
    ``out.safetensors``). Why: mlx-lm's ``save_prompt_cache`` adds that suffix and ``load_prompt_cache`` (through
    ``mx.load``) needs it, so a bare name was a file nothing could load. ``mlx_lm``: a name with any other suffix is
    refused (``InvalidCacheState``) — mlx-lm could not load it; kvshelf's own files keep whatever suffix is given
    (kvshelf reads them by content)."""
    target = snapshot_path(path, "output file")
    if not target.suffix:
        return target.with_name(target.name + SUFFIX)
    if mlx_lm and target.suffix != SUFFIX:
        raise InvalidCacheState(f"{target}: mlx-lm's load_prompt_cache reads only files named *{SUFFIX}; name the "
                                f"export {target.with_suffix(SUFFIX).name} (a name without a suffix gets {SUFFIX})")
    return target


def open_regular(path: Path) -> BinaryIO:
    """Open a snapshot for reading; only a regular file (a FIFO or device could block or never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise file_error(exc, f"cannot open snapshot {path}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptData(f"{path}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def identity_fields(identity: Any, what: str = "identity") -> dict[str, str]:
    """The identity fields given: from None, a mapping, or an object with those attributes (the store's Identity).

    Only fields that are present and not None are returned; unknown mapping keys are refused.
    """
    if identity is None:
        return {}
    if isinstance(identity, Mapping):
        unknown = sorted(set(identity) - set(IDENTITY_FIELDS))
        if unknown:
            raise InvalidCacheState(f"{what} has unknown fields {unknown} (known: {', '.join(IDENTITY_FIELDS)})")
        values = {field: identity.get(field) for field in IDENTITY_FIELDS}
    else:
        values = {field: getattr(identity, field, None) for field in IDENTITY_FIELDS}
    out = {}
    for field, value in values.items():
        if value is None:
            continue
        if not isinstance(value, str):
            raise WrongArgumentType(f"{what} field {field} must be a string (got {type(value).__name__})")
        if len(value) > MAX_IDENTITY_CHARS:
            raise InvalidCacheState(f"{what} field {field} is {len(value)} characters (at most {MAX_IDENTITY_CHARS})")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidCacheState(f"{what} field {field} is not valid Unicode (lone surrogate at {exc.start})") from None
        out[field] = value
    return out


def check_identity(header: SnapshotHeader, expect: Any) -> None:
    """Every identity field the caller expects must equal the header's (``IdentityMismatch`` names it)."""
    for field, expected in identity_fields(expect, "expected identity").items():
        stored = getattr(header, field)
        if stored != expected:
            raise IdentityMismatch(field, stored, expected)


__all__ = ["normalize_tokens", "snapshot_path", "export_path", "open_regular", "identity_fields", "check_identity"]
