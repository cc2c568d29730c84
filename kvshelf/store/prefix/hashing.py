"""Prefix keys: a hash per block boundary of a token sequence, scoped by identity and namespace.

The boundary after ``j`` tokens is ``xxh3_128(nsk || int64le(t[:j]))``, recorded at j = 1..block-1 and every multiple
of ``block``. Saving computes the boundaries it writes with one streaming hash (O(T) hashing; ``records.py`` keeps
the index writes O(change)); a lookup computes single boundaries directly (a prefix of 32k tokens is 256 KiB: ~20 µs),
so it can binary-search the deepest stored boundary with O(log T) index gets. Every session's current snapshot has all
its boundaries in the table, so the stored set is prefix-closed and the search is exact. Hashes only nominate
candidates; tokens are always compared.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from ...errors import InvalidCacheState

BLOCK_TOKENS = 16


def tokens_array(tokens: Sequence[int] | np.ndarray, what: str = "tokens") -> np.ndarray:
    """Tokens as a C-contiguous little-endian int64 array (lists, tuples, numpy or MLX 1-D arrays)."""
    if hasattr(tokens, "tolist") and not isinstance(tokens, np.ndarray):
        tokens = np.array(tokens.tolist())
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise InvalidCacheState(f"{what} must be a sequence of ints ({exc})") from None
    if arr.size == 0:
        return np.zeros(0, dtype="<i8")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidCacheState(f"{what} must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype="<i8")
    if arr.min() < 0:
        raise InvalidCacheState(f"{what} must be non-negative token ids (found {int(arr.min())})")
    return arr


def positions(n: int, block: int = BLOCK_TOKENS) -> list[int]:
    """The boundary positions a sequence of ``n`` tokens records: 1 .. block-1 (so short prompts find long
    snapshots), then every multiple of ``block``. Every snapshot records all of its own, so the set is prefix-closed."""
    return [*range(1, min(n, block - 1) + 1), *range(block, n + 1, block)]


def level_bound(pos, level: int, n: int) -> int:
    """The longest usable prefix (of a prompt of ``n`` tokens, boundary positions ``pos``) that a snapshot first met
    at boundary index ``level`` can give: it shares no boundary deeper than ``level``, and a hit leaves one token."""
    deeper = pos[level + 1] - 1 if level + 1 < len(pos) else n
    return min(deeper, n - 1)


def boundary_hash(nsk: bytes, tokens: np.ndarray, position: int) -> bytes:
    """The key of the boundary after the first ``position`` tokens."""
    h = xxhash.xxh3_128(nsk)
    h.update(memoryview(tokens)[:position])
    return h.digest()


def all_boundaries(nsk: bytes, tokens: np.ndarray, block: int = BLOCK_TOKENS) -> list[tuple[bytes, bytes]]:
    """(key, continuation) of every boundary of ``tokens``, in one streaming pass (O(len))."""
    return boundaries_after(nsk, tokens, 0, block)


def boundaries_after(nsk: bytes, tokens: np.ndarray, after: int,
                     block: int = BLOCK_TOKENS) -> list[tuple[bytes, bytes]]:
    """(key, continuation) of the boundaries of ``tokens`` at positions > ``after``: the tail a re-save of a grown or
    changed session may have to rewrite. The hash still streams over the whole prefix (hashing is ~10 GB/s; it is
    the index writes that must stay O(change)), but only the tail's records are built."""
    h = xxhash.xxh3_128(nsk)
    view = memoryview(tokens)
    out, done = [], 0
    for pos in positions(len(tokens), block):
        if pos <= after:
            continue
        h.update(view[done:pos])
        done = pos
        out.append((h.digest(), continuation(tokens, pos, block)))
    return out


_PAD = b"\xff" * 8  # sorts after every token id (ids are < 2**62)


def continuation(tokens: np.ndarray, position: int, block: int = BLOCK_TOKENS) -> bytes:
    """The ``block`` tokens after ``position`` as big-endian int64, padded with 0xff: prefix records are sorted by it,
    so among thousands of snapshots sharing a boundary the ones continuing most like the prompt are neighbours."""
    nxt = tokens[position:position + block]
    return nxt.astype(">i8").tobytes() + _PAD * (block - len(nxt))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


__all__ = ["BLOCK_TOKENS", "level_bound", "positions", "tokens_array", "boundary_hash", "all_boundaries", "boundaries_after",
           "continuation", "common_prefix"]
