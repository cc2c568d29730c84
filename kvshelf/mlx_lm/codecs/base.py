"""What every codec of mlx-lm's own cache classes shares: serial checks, load-with-validation, batching by merge.

mlx-lm's caches are restored as instances of the same mlx-lm classes (their ``state`` setters and constructors,
never a subclass), so every mlx-lm code path keeps working on them. Batching follows mlx-lm exactly: a batch of
restored rows is what the class's own ``merge`` builds from them (``BatchKVCache``, ``BatchRotatingKVCache``,
``ArraysCache``, ``CacheList``); classes mlx-lm cannot batch (no ``merge``) are refused with a clear error instead
of being batched some other way that mlx-lm model code would read wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ...codecs import validate
from ...codecs.batch_plan import BatchPlan
from ...codecs.header import CacheEntry
from ...codecs.kinds.latent_common import check_prefix, prefix_tensors, replace_entry
from ...errors import InvalidCacheState, KvShelfError

MAX_CAPACITY = 2**31


def python_int(value: Any, what: str) -> int:
    """An mlx-lm scalar (Python int, or a 0-d / one-element mx.array) as a non-negative Python int."""
    if isinstance(value, mx.array):
        if value.size != 1:
            raise InvalidCacheState(f"{what} holds {value.size} values; persistence takes one serial row")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidCacheState(f"{what} must be a non-negative int (got {value!r})")
    return value


def require_one_row(array: mx.array | None, what: str) -> None:
    """Persistence takes serial state: a batch of several rows must be split (``extract(i)``) first."""
    if array is not None and (array.ndim < 1 or array.shape[0] != 1):
        rows = array.shape[0] if array.ndim else 0
        raise InvalidCacheState(
            f"{what} holds {rows} rows; persistence takes serial state: save each row's cache (mlx-lm's "
            "extract(i) / BatchGenerator.extract_cache) on its own"
        )


def check_planes(what: str, planes: Sequence[mx.array]) -> None:
    """Key/value planes of one row: rank 4 ``[1, H, S, w]``, one head count and buffer length."""
    for i, plane in enumerate(planes):
        if not isinstance(plane, mx.array) or plane.ndim != 4:
            got = f"rank {plane.ndim}" if isinstance(plane, mx.array) else type(plane).__name__
            raise InvalidCacheState(f"{what}: plane {i} must be a rank-4 [1, H, S, D] mlx array (got {got})")
        require_one_row(plane, what)
        if plane.shape[1:3] != planes[0].shape[1:3]:
            raise InvalidCacheState(f"{what}: planes {list(planes[0].shape)} and {list(plane.shape)} disagree in [H, S]")


class MlxCodec:
    """Base of the mlx-lm codecs (``kind``, ``cache_type`` and the per-kind hooks come from subclasses)."""

    kind: str
    cache_type: type
    # The layout of what this codec writes and reads. Bumped when a codec (or the mlx-lm cache class it mirrors)
    # changes what a stored snapshot means; served models' identities include every codec's tag, so a bump makes
    # old snapshots another identity's (a miss, reclaimed by ``kvshelf gc --incompatible``) while an mlx or
    # mlx-lm patch release that keeps the layout keeps the store.
    format_tag = 1
    also_matches: tuple[type, ...] = ()
    takes_length = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r})"

    def matches(self, cache: object) -> bool:
        return type(cache) is self.cache_type or type(cache) in self.also_matches

    # -- hooks -------------------------------------------------------------------------------------------------
    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        raise NotImplementedError

    def _build(self, entry: CacheEntry, arrays: list[mx.array], index: int | None) -> Any:
        """The mlx-lm cache of a validated entry and its checked arrays."""
        raise NotImplementedError

    # -- loading -----------------------------------------------------------------------------------------------
    def load(self, entry: CacheEntry, arrays: Sequence[mx.array], *, verify: bool = True,
             index: int | None = None) -> Any:
        self.validate(entry, index)
        validate.check_arrays(entry, index, arrays, verify)
        return self._build(entry, list(arrays), index)

    def _check_batch(self, entries: Sequence[CacheEntry]) -> None:
        merge = getattr(self.cache_type, "merge", None)
        if merge is None:
            raise InvalidCacheState(
                f"{self.kind}: mlx-lm's {self.cache_type.__name__} has no batched form (it has no merge), so mlx-lm "
                "model code cannot run these rows as one batch; restore the sessions one by one"
            )
        if not entries:
            raise InvalidCacheState(f"{self.kind}: a batch needs at least one row")
        for i, entry in enumerate(entries):
            if entry.kind != self.kind:
                raise InvalidCacheState(f"{self.kind}: row {i} is a {entry.kind!r} entry; only one kind batches")
            self.validate(entry, i)

    def _merge(self, rows: list[Any]) -> Any:
        try:
            return self.cache_type.merge(rows)
        except KvShelfError:
            raise
        except Exception as exc:  # mlx-lm's merge refuses rows it cannot lay out together
            raise InvalidCacheState(f"{self.kind}: mlx-lm cannot batch these rows: {type(exc).__name__}: {exc}") from exc

    def load_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], *,
                   verify: bool = True) -> Any:
        """What mlx-lm's own ``merge`` builds from the restored rows."""
        entries = list(entries)
        self._check_batch(entries)
        if len(arrays_per_row) != len(entries):
            raise InvalidCacheState(f"{self.kind}: {len(entries)} entries but {len(arrays_per_row)} array lists")
        rows = [self.load(e, a, verify=verify, index=i) for i, (e, a) in enumerate(zip(entries, arrays_per_row))]
        return self._merge(rows)

    def batch_plan(self, entries: Sequence[CacheEntry]) -> BatchPlan | None:
        """None (rows go through ``load_batch``) unless a subclass lays the batch out directly."""
        self._check_batch(list(entries))
        return None

    def adopt_batch(self, entries: Sequence[CacheEntry], arrays: Sequence[mx.array]) -> Any:
        raise NotImplementedError(f"{self.kind}: no batch plan, so nothing to adopt")

    # -- prefixes ----------------------------------------------------------------------------------------------
    def header_trimmable(self, entry: CacheEntry) -> bool:
        return True

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_prefix(entry, p)
        return replace_entry(entry, offset=p, tensors=prefix_tensors(entry, p))


__all__ = ["MAX_CAPACITY", "MlxCodec", "check_planes", "python_int", "require_one_row"]
