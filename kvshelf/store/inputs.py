"""Bounded, checked inputs: what the store's public calls accept, checked before anything is read or written.

Why here and why these numbers: a value the index cannot hold must be refused at the door, not discovered by LMDB
(``BadValsizeError``), by the UTF-8 encoder (``UnicodeEncodeError``) or by the next restore (``CorruptData`` forever).
Every check is a pure function that raises ``InvalidCacheState`` (a ``ValueError``; ``WrongArgumentType``, also a
``TypeError``, for arguments of the wrong type) with a message naming the argument.

Documented maxima (docs/API.md, "Input limits"):

* ``session_id``: a non-empty ``str`` of at most ``MAX_SESSION_ID_BYTES`` = 448 UTF-8 bytes. LMDB keys hold at most
  511 bytes; a session key is ``identity key (16) + namespace key (16) + session id``, so 479 would fit today — 448
  leaves 31 bytes for the key parts a later index layout may add (a kind byte, a version, a length prefix).
* ``namespace``: a ``str`` (may be empty) of at most ``MAX_NAMESPACE_BYTES`` = 256 UTF-8 bytes. Keys carry only its
  16-byte hash (256 + 448 would not fit one key: the index must keep hashing it), records carry it whole.
* identity fields (``model_id``, ``config_fingerprint``, ``tokenizer_hash``): ``str`` of at most 1,024 UTF-8 bytes.
* all of these: valid UTF-8 (no lone surrogates) and no NUL character.
* token ids: integers with ``0 <= id < 2**31`` (``TOKEN_ID_LIMIT``; every tokenizer's vocabulary fits, and the
  value survives int32 paths such as ``mx.array(tokens, dtype=mx.int32)``). Tokens are a ``Sequence[int]`` (list,
  tuple, range) or a 1-D integer numpy/MLX array; arrays are checked vectorised, lists through ``array('q')``.
* snapshot ids: 32 hexadecimal digits (what ``SnapshotInfo.snapshot_id`` and ``PrefixHit.snapshot_id`` hold).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..codecs.header import TOKEN_ID_LIMIT
from ..errors import InvalidCacheState, WrongArgumentType
from .results import PrefixHit

MAX_SESSION_ID_BYTES = 448
MAX_NAMESPACE_BYTES = 256
MAX_IDENTITY_FIELD_BYTES = 1024
MAX_TENANT_BYTES = 256
MAX_SCOPE_BYTES = 128  # a tenant scope: mark + "t:" + token (<= 64 bytes or "~" + 32 hex) + salt mark + "s:" + 32 hex
TENANT_MARK = "\x1e"  # where a namespace's tenant scope starts (identity.py composes scopes)

SNAPSHOT_ID_HEX = 32


def _text(value: Any, what: str, max_bytes: int, *, empty: bool) -> bytes:
    """``value`` as UTF-8 bytes after every rule that applies to names: str, bounded, no NUL, no lone surrogate."""
    if not isinstance(value, str):
        raise WrongArgumentType(f"{what} must be a str, got {type(value).__name__}")
    if not value and not empty:
        raise InvalidCacheState(f"{what} must not be empty")
    if len(value) > max_bytes:  # every character is at least one byte: refuse before encoding a huge string
        raise InvalidCacheState(f"{what} is longer than {max_bytes} UTF-8 bytes ({len(value)} characters)")
    if "\x00" in value:
        raise InvalidCacheState(f"{what} must not contain a NUL character (at index {value.index(chr(0))})")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidCacheState(f"{what} is not valid Unicode text: a lone surrogate at index {exc.start}") from None
    if len(raw) > max_bytes:
        raise InvalidCacheState(f"{what} is {len(raw)} UTF-8 bytes long (at most {max_bytes})")
    return raw


def check_session_id(session_id: Any) -> str:
    """A session id the index can key: non-empty str, <= 448 UTF-8 bytes, no NUL, no lone surrogate."""
    _text(session_id, "session_id", MAX_SESSION_ID_BYTES, empty=False)
    return session_id


def check_namespace(namespace: Any) -> str:
    """A namespace: str (empty is the default namespace), <= 256 UTF-8 bytes, no NUL, no lone surrogate. A tenant's
    scope (``identity.tenant_scope``, starting at ``TENANT_MARK``) may add up to ``MAX_SCOPE_BYTES`` more: the
    caller's namespace keeps its full 256 bytes inside a tenant (keys carry only the namespace's hash)."""
    if isinstance(namespace, str) and TENANT_MARK in namespace:
        base, _mark, scope = namespace.rpartition(TENANT_MARK)
        _text(base, "namespace", MAX_NAMESPACE_BYTES, empty=True)
        _text(scope, "namespace's tenant scope", MAX_SCOPE_BYTES, empty=True)
        return namespace
    _text(namespace, "namespace", MAX_NAMESPACE_BYTES, empty=True)
    return namespace


def check_tenant(tenant: Any) -> str:
    """A tenant name: str (empty is the default tenant), <= 256 UTF-8 bytes, no NUL, no lone surrogate."""
    _text(tenant, "tenant", MAX_TENANT_BYTES, empty=True)
    return tenant


def check_optional_namespace(namespace: Any) -> str | None:
    """``sessions(namespace=None)`` lists every namespace; anything else must be a valid namespace."""
    return None if namespace is None else check_namespace(namespace)


def check_session(session_id: Any, namespace: Any) -> None:
    """The (session id, namespace) pair of save, restore and delete."""
    check_session_id(session_id)
    check_namespace(namespace)


def check_identity_field(name: str, value: Any) -> str:
    """One field of an ``Identity``: str, <= 1,024 UTF-8 bytes, no NUL, no lone surrogate (empty allowed)."""
    _text(value, f"Identity.{name}", MAX_IDENTITY_FIELD_BYTES, empty=True)
    return value


def _is_mx_array(value: Any) -> bool:
    return type(value).__module__.startswith("mlx") and hasattr(value, "dtype") and hasattr(value, "shape")


def _first_bad(tokens: Sequence[Any], what: str) -> InvalidCacheState:
    """The precise error for a list that ``array('q')`` refused (only on the error path: a Python loop is fine)."""
    for i, token in enumerate(tokens):
        if not isinstance(token, (int, np.integer)):
            return WrongArgumentType(f"{what}[{i}] must be an int token id, got {type(token).__name__} {token!r:.40}")
        if not 0 <= int(token) < TOKEN_ID_LIMIT:
            return InvalidCacheState(f"{what}[{i}] must be a non-negative int token id below 2**31 (got {int(token)})")
    return InvalidCacheState(f"{what} must be a sequence of int token ids")


def _bounded(arr: np.ndarray, what: str) -> np.ndarray:
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= TOKEN_ID_LIMIT:
            i = int(np.argmax((arr < 0) | (arr >= TOKEN_ID_LIMIT)))
            raise InvalidCacheState(f"{what}[{i}] must be a non-negative int token id below 2**31 (got {int(arr[i])})")
    return arr


def check_tokens(tokens: Any, what: str = "tokens") -> np.ndarray:
    """Token ids as a C-contiguous little-endian int64 array, every id in ``[0, 2**31)``.

    Arrays (numpy, MLX) must be 1-D with an integer dtype (bool refused) and are checked with one min/max pass;
    other sequences are converted by ``array('q')`` (C speed; floats refused, Python bools are ints)."""
    if _is_mx_array(tokens):
        import mlx.core as mx

        if tokens.ndim != 1 or not mx.issubdtype(tokens.dtype, mx.integer):
            raise InvalidCacheState(f"{what} must be a 1-D integer array, got shape {list(tokens.shape)} "
                                    f"dtype {tokens.dtype}")
        tokens = np.array(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise InvalidCacheState(f"{what} must be a 1-D integer array, got shape {list(tokens.shape)} "
                                    f"dtype {tokens.dtype}")
        if tokens.dtype.kind == "u" and tokens.size and int(tokens.max()) >= TOKEN_ID_LIMIT:
            return _bounded(tokens.astype(np.float64), what)  # raises with the position (uint64 may not fit int64)
        return _bounded(np.ascontiguousarray(tokens, dtype="<i8"), what)
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence):
        raise WrongArgumentType(f"{what} must be a sequence of int token ids or a 1-D integer array, "
                                f"got {type(tokens).__name__}")
    try:
        packed = array("q", tokens)
    except (TypeError, ValueError, OverflowError):
        raise _first_bad(tokens, what) from None
    arr = np.frombuffer(packed, dtype=np.int64).astype("<i8", copy=False) if len(packed) else np.zeros(0, "<i8")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_ID_LIMIT):
        return _bounded(arr, what)
    return arr


def check_prompt(tokens: Any, what: str = "prompt_tokens") -> Any:
    """A lookup prompt: arrays are checked whole (one vectorised pass); a list or tuple only by type here — the
    lookup converts and checks it as far as it reads it, so a miss on a 32k-token list stays microseconds (an id
    the store cannot hold can never match a stored token, so the unread tail cannot change an answer)."""
    if isinstance(tokens, (list, tuple)):
        return tokens
    return check_tokens(tokens, what)


def check_snapshot_id(snapshot_id: Any, what: str = "snapshot_id") -> str:
    """A snapshot id: 32 hex digits (case-insensitive; returned in lower case, as the store writes them)."""
    if not isinstance(snapshot_id, str):
        raise WrongArgumentType(f"{what} must be a str of {SNAPSHOT_ID_HEX} hex digits, "
                                f"got {type(snapshot_id).__name__}")
    sid = snapshot_id.lower()
    if len(sid) != SNAPSHOT_ID_HEX or any(c not in "0123456789abcdef" for c in sid):
        raise InvalidCacheState(f"{what} must be {SNAPSHOT_ID_HEX} hex digits, got {snapshot_id!r:.80}")
    return sid


def check_length(length: Any, what: str = "length") -> int | None:
    """An optional cut length: None or a non-negative int (bools and floats refused)."""
    if length is None:
        return None
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        raise WrongArgumentType(f"{what} must be an int or None, got {type(length).__name__}")
    if length < 0:
        raise InvalidCacheState(f"{what} must be >= 0, got {int(length)}")
    return int(length)


def check_hit(hit: PrefixHit, what: str = "request") -> None:
    """A ``PrefixHit`` handed back to the store (it may have been built by the caller): id and length well formed."""
    check_snapshot_id(hit.snapshot_id, f"{what}.snapshot_id")
    check_length(hit.length, f"{what}.length")


def check_requests(requests: Any) -> None:
    """``restore_batch`` requests: a non-empty list/tuple of session ids, ``PrefixHit``s or (session, namespace)."""
    if isinstance(requests, (str, bytes, bytearray, memoryview)) or not isinstance(requests, Sequence):
        raise WrongArgumentType(f"restore_batch takes a sequence of requests, got {type(requests).__name__}")
    if not requests:
        raise InvalidCacheState("restore_batch needs at least one request")
    for i, req in enumerate(requests):
        what = f"requests[{i}]"
        if isinstance(req, PrefixHit):
            check_hit(req, what)
        elif isinstance(req, tuple):
            if len(req) != 2:
                raise InvalidCacheState(f"{what} must be a (session_id, namespace) pair, got {len(req)} items")
            check_session(*req)
        elif isinstance(req, str):
            check_session_id(req)
        else:
            raise WrongArgumentType(f"{what} must be a session id, a PrefixHit or a (session_id, namespace) "
                                    f"tuple, got {type(req).__name__}")


__all__ = [
    "MAX_IDENTITY_FIELD_BYTES",
    "MAX_NAMESPACE_BYTES",
    "MAX_SCOPE_BYTES",
    "MAX_SESSION_ID_BYTES",
    "MAX_TENANT_BYTES",
    "TOKEN_ID_LIMIT",
    "check_hit",
    "check_identity_field",
    "check_length",
    "check_namespace",
    "check_optional_namespace",
    "check_prompt",
    "check_requests",
    "check_session",
    "check_session_id",
    "check_snapshot_id",
    "check_tenant",
    "check_tokens",
]
