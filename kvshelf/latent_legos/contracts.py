"""The contracts every latent cache honours, as structural protocols plus the two value types they exchange.

The protocols are ``runtime_checkable`` so callers (codecs, the store, tests) can ask "is this a batchable
cache" without importing concrete classes; they check method presence only, the behaviour is documented here
and tested in ``tests/legos/test_row_contract_properties.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx

from ..errors import InvalidCacheState


def _counts(values: Sequence[int] | None, name: str, rows: int | None) -> list[int] | None:
    if values is None:
        return None
    out = [int(v) for v in values]
    if any(isinstance(v, bool) or v < 0 for v in values) or any(o != v for o, v in zip(out, values)):
        raise InvalidCacheState(f"prefill {name} must be non-negative integers (got {list(values)!r})")
    if rows is not None and len(out) != rows:
        raise InvalidCacheState(f"prefill {name} has {len(out)} rows, lengths has {rows}")
    return out


@dataclass(frozen=True)
class PrefillPadding:
    """How a padded batched prefill lays out its input columns, per row.

    ``lengths[b]`` counts row b's input columns before its trailing padding (left padding included);
    ``left_padding[b]`` leading padding columns (only on a cache with no stored columns), ``right_padding[b]``
    trailing padding columns. After the padded append(s), ``finalize_prefill()`` turns trailing padding into
    leading padding, so every row ends at the same column again.
    """

    lengths: Sequence[int]
    left_padding: Sequence[int] | None = None
    right_padding: Sequence[int] | None = None

    def __post_init__(self) -> None:
        lengths = _counts(self.lengths, "lengths", None)
        if not lengths:
            raise InvalidCacheState("prefill lengths must name at least one row")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "left_padding", _counts(self.left_padding, "left_padding", len(lengths)))
        object.__setattr__(self, "right_padding", _counts(self.right_padding, "right_padding", len(lengths)))


@dataclass(frozen=True)
class LatentAttentionState:
    """float32 ``[B, T, W]`` reads of every stored position (zeros in padding); ``index_keys`` only on DSA layers."""

    latent: mx.array
    rope: mx.array
    index_keys: mx.array | None = None

    @classmethod
    def of(cls, families: Sequence[mx.array]) -> LatentAttentionState:
        """The state from per-family reads in stored order (latent, rope[, index])."""
        return cls(families[0], families[1], families[2] if len(families) > 2 else None)


@runtime_checkable
class Cache(Protocol):
    """What every cache of the library offers (mlx-lm's calling names where they exist)."""

    @property
    def offset(self) -> int: ...
    @property
    def state(self) -> list[mx.array]: ...
    minimum_reusable_offset: int

    def signature(self) -> str: ...
    def bytes_per_token(self) -> int | float: ...
    def is_trimmable(self) -> bool: ...
    def trim(self, n: int) -> int: ...
    def dispose(self) -> None: ...


@runtime_checkable
class BatchableCache(Cache, Protocol):
    """Dynamic-row batching: rows join (merge), leave (filter) and are taken out serially (extract)."""

    @property
    def batch_size(self) -> int | None: ...
    @property
    def row_offsets(self) -> list[int]: ...
    @property
    def left_pad(self) -> list[int]: ...

    def make_empty_batch(self) -> BatchableCache: ...
    def merge_rows(self, rows: Sequence[BatchableCache]) -> None: ...
    def extract_row(self, row: int) -> BatchableCache: ...
    def filter_rows(self, keep: Sequence[int]) -> None: ...
    def projected_bytes(self, tokens: int) -> int: ...


@runtime_checkable
class EditEpoch(Protocol):
    """A cache that can say "nothing below my offset changed since you last looked".

    ``kvshelf_epoch`` (an int) changes on EVERY operation that may alter a stored position below the current
    offset — trim, speculative rollback, prefill padding, row filter / merge / extract into / adopt / restore,
    ``extend``, assigning ``keys`` / ``values`` / ``minimum_reusable_offset``, an encoded row converting (its
    shadow leaves), dispose — and stays the same across appends at the end. Values come from one process-wide
    counter and are never reused. The store uses it to reuse a grown session's chunk hashes (``store/save/hash_reuse.py``),
    so a missing bump would store stale bytes: when in doubt a method bumps.

    Not covered: writes into arrays a cache hands out (``state``, ``keys``, ``values`` of ``KVCache`` are its
    buffers) made by item assignment outside the cache. Writes must go through the cache's methods or setters.
    Implemented by ``MLACache``, ``EncodedLatentCache`` and the token-axis key/value legos (``KVCache``,
    ``QuantizedKVCache``, ``TurboQuantKVCache``). Paged, rotating and arrays caches store no token axis (the store
    always hashes them whole) and do not implement it; neither do mlx-lm's classes.
    """

    @property
    def kvshelf_epoch(self) -> int: ...


def edit_epoch(cache: object) -> int | None:
    """The cache's ``kvshelf_epoch``, or None when it does not implement the protocol (mlx-lm's classes, ...)."""
    epoch = getattr(type(cache), "kvshelf_epoch", None)
    if epoch is None:
        return None
    value = getattr(cache, "kvshelf_epoch")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@runtime_checkable
class SpeculativeTransaction(Protocol):
    """A verify window appended after ``spec_round_begin`` keeps ``keep`` (int or per row) of its positions."""

    def spec_round_begin(self) -> None: ...
    def spec_round_commit(self) -> None: ...
    def spec_round_rollback(self, keep: int | Sequence[int]) -> None: ...


@runtime_checkable
class PaddedPrefillCache(Protocol):
    def prepare_prefill(self, padding: PrefillPadding) -> None: ...
    def finalize_prefill(self) -> None: ...


@runtime_checkable
class LatentAttentionCache(BatchableCache, SpeculativeTransaction, PaddedPrefillCache, Protocol):
    """The compressed-MLA state: latent, decoupled RoPE key and (DSA layers) index key per position."""

    def append_latent(
        self, latent: mx.array, rope: mx.array, index_keys: mx.array | None = None
    ) -> LatentAttentionState: ...
    def stored_index_keys(self) -> mx.array | None: ...


__all__ = [
    "PrefillPadding",
    "LatentAttentionState",
    "Cache",
    "BatchableCache",
    "EditEpoch",
    "edit_epoch",
    "SpeculativeTransaction",
    "PaddedPrefillCache",
    "LatentAttentionCache",
]
