"""The right-justified row layout shared by ``MLACache`` and ``EncodedLatentCache`` (its bookkeeping by ``TokenRows``).

Every held array is ``[B, width, w]``; row b occupies columns ``[width - row_offsets[b], width)`` and every
column before that is padding holding zeros. A subclass says which arrays it holds (``_stored``/``_publish``)
and what per-row metadata follows a row (``_select_rows``); the row bookkeeping, trim, speculative rollback,
prefill padding and filtering live here. Each operation validates, stages new arrays, then publishes, so a
rejected call leaves the cache exactly as it was. Every operation but an append bumps the edit epoch
(``cache_parts.EditEpoch``): each may move or drop a stored position.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..errors import CacheRangeError, InvalidCacheState
from .cache_parts import EditEpoch, describe
from .contracts import PrefillPadding
from .latent.geometry import LatentGeometry
from .rows import (
    append_inputs,
    check_keep,
    check_token_room,
    non_negative,
    roll_rows_right,
    take_rows,
    zero_leading,
)


def check_keep_counts(keep: int | Sequence[int], appended: Sequence[int]) -> list[int]:
    """Validate a rollback's ``keep`` (one count or one per row) against what each row appended since begin."""
    if isinstance(keep, int) and not isinstance(keep, bool):
        counts = [keep] * len(appended)
    else:
        counts = list(keep)
        if len(counts) != len(appended):
            raise InvalidCacheState(f"rollback keep has {len(counts)} rows, the cache has {len(appended)}")
    for row, (k, a) in enumerate(zip(counts, appended)):
        non_negative(k, "rollback keep")
        if k > a:
            raise CacheRangeError(f"rollback keeps {k} positions of row {row}, which appended only {a} this round")
    return counts


def round_start(before: list[int], rows: int) -> list[int]:
    """Row offsets when the round began; a round begun on a cache without rows began every row at 0."""
    if not before and rows:
        return [0] * rows
    if len(before) != rows:
        raise InvalidCacheState(f"the speculative round began with {len(before)} rows, the cache now has {rows}")
    return before


def padding_rows(padding: object, batch: int | None) -> int:
    """The rows a ``prepare_prefill`` padding names, which must be the cache's rows once it has any."""
    if not isinstance(padding, PrefillPadding):
        raise InvalidCacheState(f"prepare_prefill takes a PrefillPadding (got {type(padding).__name__})")
    rows = len(padding.lengths)
    if batch is not None and rows != batch:
        raise InvalidCacheState(f"prefill padding names {rows} rows, the cache has {batch}")
    return rows


class RowBookkeeping(EditEpoch):
    """Per-row offsets of a right-justified layout (``RightJustifiedRows`` and the kv ``TokenRows``): every row
    ends at column ``_width`` and row b holds its last ``_offsets[b]`` columns. Prefill padding, speculative rounds
    and which rows stay are kept here; a subclass trims and lays its storage out again (``trim``/``_relayout``)."""

    def _reset_rows(self) -> None:
        self._edited()
        self._batch: int | None = None
        self._offsets: list[int] = []
        self._width = 0
        self._ends: list[int] | None = None
        self._prefill_pending = False
        self._round: list[int] | None = None

    def _create_rows(self, batch: int) -> None:
        """Per-row metadata for ``batch`` fresh rows."""

    def _relayout(self, shifts: Sequence[int]) -> None:
        """Row b drops its last ``shifts[b]`` positions; padding is zeroed and padding common to all rows removed."""
        raise NotImplementedError

    def trim(self, n: int) -> int:
        raise NotImplementedError

    # -- row layout ----------------------------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        """The physical width, i.e. the write head: every row ends at this column (mlx-lm's serial ``offset``)."""
        return self._width

    @property
    def batch_size(self) -> int | None:
        return self._batch

    @property
    def row_offsets(self) -> list[int]:
        return list(self._offsets)

    @property
    def left_pad(self) -> list[int]:
        return [self._width - o for o in self._offsets]

    def is_trimmable(self) -> bool:
        return True

    def _begin_rows(self, batch: int) -> None:
        self._edited()
        self._batch, self._offsets, self._width = batch, [0] * batch, 0
        self._create_rows(batch)

    # -- the speculative transaction ---------------------------------------------------------------------------
    def spec_round_begin(self) -> None:
        self._round = list(self._offsets)

    def spec_round_commit(self) -> None:
        self._round = None

    def _round_before(self, round_offsets: list[int]) -> list[int]:
        """Row offsets the rollback measures appends from."""
        return round_offsets

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        """Keep ``keep`` (one count or one per row) of the positions each row appended since begin."""
        if self._round is None:
            raise InvalidCacheState("spec_round_rollback without spec_round_begin")
        self._edited()
        before = self._round_before(self._round)
        counts = check_keep_counts(keep, [o - b for o, b in zip(self._offsets, before)])
        rejected = [o - b - k for o, b, k in zip(self._offsets, before, counts)]
        if len(set(rejected)) <= 1:
            self.trim(rejected[0] if rejected else 0)
        else:
            self._relayout(rejected)
        self._round = None

    # -- prefill padding -------------------------------------------------------------------------------------------
    def prepare_prefill(self, padding: PrefillPadding) -> None:
        rows = padding_rows(padding, self._batch)
        left = padding.left_padding or [0] * rows
        if any(left) and self._width > 0:
            raise InvalidCacheState("left padding can only be added to a cache with no stored positions")
        if self._batch is None:
            self._begin_rows(rows)
        self._edited()
        self._offsets = [o - p for o, p in zip(self._offsets, left)]
        right = padding.right_padding
        self._ends = [o + n for o, n in zip(self._offsets, padding.lengths)] if right and any(right) else None
        self._prefill_pending = True

    def finalize_prefill(self) -> None:
        """Trailing padding rolls to the front (as zeros) and padding common to every row is dropped."""
        if not self._prefill_pending:
            return
        self._edited()
        ends = self._ends
        shifts = [max(0, o - e) for o, e in zip(self._offsets, ends)] if ends else [0] * len(self._offsets)
        self._relayout(shifts)
        self._ends, self._prefill_pending = None, False

    # -- rows leaving --------------------------------------------------------------------------------------------
    def _keep_row_bookkeeping(self, keep: list[int], width: int) -> None:
        """After ``filter_rows`` restaged the storage: rows ``keep`` remain, ``width`` columns wide."""
        self._edited()
        self._batch, self._width = len(keep), width
        self._offsets = [self._offsets[k] for k in keep]
        if self._ends is not None:
            self._ends = [self._ends[k] for k in keep]
        if self._round is not None:
            self._round = [self._round[k] for k in keep]


def check_merge_sources(dest: object, rows: Sequence[object]) -> list[object]:
    """The sources of ``dest.merge_rows``: same class, signature and geometry, prefill finalized; ``dest`` empty."""
    if dest.batch_size is not None:
        raise InvalidCacheState("merge_rows needs an empty destination cache (make_empty_batch())")
    rows = list(rows)
    if not rows:
        raise InvalidCacheState("merge_rows needs at least one source cache")
    for source in rows:
        if type(source) is not type(dest) or source.signature() != dest.signature():
            raise InvalidCacheState(f"cannot merge {describe(source)} into {dest.signature()}")
        if source.geometry != dest.geometry:
            raise InvalidCacheState(f"cannot merge geometry {source.geometry} into {dest.geometry}")
        source._require_serial_rows("merge_rows")
    return rows


class RightJustifiedRows(RowBookkeeping):
    """Row bookkeeping for right-justified caches (see the module docstring)."""

    geometry: LatentGeometry

    def __init__(self, geometry: LatentGeometry) -> None:
        if not isinstance(geometry, LatentGeometry):
            raise InvalidCacheState(f"geometry must be a LatentGeometry (got {type(geometry).__name__})")
        self.geometry = geometry
        self._reset_rows()

    # -- subclass hooks ------------------------------------------------------------------------------------------
    def _stored(self) -> list[mx.array]:
        """Every held array ``[B, width, w]`` (``[]`` while width is 0)."""
        raise NotImplementedError

    def _publish(self, arrays: list[mx.array]) -> None:
        """Replace the held arrays with ``arrays`` (same order as ``_stored``; ``[]`` when width becomes 0)."""
        raise NotImplementedError

    def _truncate(self, width: int) -> None:
        """Every held array keeps its first ``width`` columns (``trim``); capacity-holding subclasses only move
        their write head back."""
        self._publish([a[:, :width, :] for a in self._stored()] if width else [])

    def _select_rows(self, keep: list[int]) -> None:
        """Per-row metadata follows ``filter_rows``."""

    def _require_serial_rows(self, what: str) -> None:
        if self._prefill_pending:
            raise InvalidCacheState(f"{what} needs a finalized prefill; call finalize_prefill() first")

    # -- trim and the speculative transaction ------------------------------------------------------------------
    def trim(self, n: int) -> int:
        non_negative(n, "trim count")
        if n == 0:
            return 0
        shortest = min(self._offsets) if self._offsets else 0
        if n > shortest:
            raise CacheRangeError(f"cannot trim {n} positions: the shortest row holds {shortest}")
        keep = self._width - n
        self._edited()
        self._truncate(keep)
        self._width = keep
        self._offsets = [o - n for o in self._offsets]
        return n

    def _round_before(self, round_offsets: list[int]) -> list[int]:
        return round_start(round_offsets, len(self._offsets))

    def _relayout(self, shifts: Sequence[int]) -> None:
        self._edited()
        offsets = [o - s for o, s in zip(self._offsets, shifts)]
        pads = [self._width - o for o in offsets]
        drop = min(max(0, min(pads, default=0)), self._width)
        arrays = self._stored()
        if arrays:
            arrays = zero_leading(roll_rows_right(arrays, shifts), pads)
            arrays = [a[:, drop:, :] for a in arrays] if drop < self._width else []
        self._publish(arrays)
        self._width -= drop
        self._offsets = offsets

    # -- rows leaving --------------------------------------------------------------------------------------------
    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` in that order; padding columns common to the survivors are removed."""
        keep = check_keep(keep, self._batch)
        pads = self.left_pad
        drop = min(max(0, min(pads[k] for k in keep)), self._width)
        width = self._width - drop
        arrays = take_rows(self._stored(), keep, drop) if width else []
        self._publish(arrays)
        self._keep_row_bookkeeping(keep, width)
        self._select_rows(keep)

    def _check_merge_sources(self, rows: Sequence[object]) -> list[object]:
        return check_merge_sources(self, rows)

    # -- appending and rows joining ------------------------------------------------------------------------------
    def _check_state(self, state: object) -> None:
        """Raise unless ``state`` is a row state this cache can hold."""
        raise NotImplementedError

    def _check_append(
        self, latent: mx.array, rope: mx.array, index_keys: mx.array | None
    ) -> tuple[list[mx.array], int, int]:
        """The appended families, their batch and length, after checking them against geometry, rows and room."""
        families = append_inputs(self.geometry, latent, rope, index_keys, self._batch)
        check_token_room(self.geometry, self._offsets, latent.shape[1])
        return families, latent.shape[0], latent.shape[1]

    def _states_to_merge(self, states: Sequence[object]) -> list[object]:
        """``merge_row_states``'s checked rows (at least one; this cache must be empty)."""
        if self._batch is not None:
            raise InvalidCacheState("merge_row_states needs an empty destination cache")
        self._edited()
        states = list(states)
        if not states:
            raise InvalidCacheState("merge needs at least one row")
        for state in states:
            self._check_state(state)
        return states

    def restore_row(self, state: object) -> None:
        """Replace this cache's contents with one row, adopting its arrays (the codecs' load path)."""
        self._check_state(state)
        self.dispose()
        self.merge_row_states([state])

    def signature(self) -> str:
        raise NotImplementedError
