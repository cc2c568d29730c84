"""``PagedLatentCache``: each row's latent state in pages of ``block_size`` positions.

Stored as the format names from the first position (``None``: float32, read bit-identical to ``MLACache``).
Each row owns a ``LatentPages``; an append writes into each row's pages in place; a read gathers every row (a view
of the pools while blocks sit in table order), decodes it and joins the rows right-justified with zero padding
(``MLACache``'s layout; one row is returned as it is, so a serial f32 read copies nothing, while a batch still
joins its rows on every read). Rows of a padded prefill hold their left padding as leading positions
(``_leading``) until ``finalize_prefill`` rewrites each row's pages to its real positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ...errors import CacheRangeError, InvalidCacheState
from ..contracts import LatentAttentionState, PrefillPadding
from .family_codec import FamilyCodec
from ..formats import LatentFormat, format_key
from .geometry import LatentGeometry
from ..cache_parts import ReuseFloor
from ..justified import check_keep_counts, check_merge_sources, padding_rows, round_start
from .pages import LatentPages, _positive
from ..rows import (append_inputs, check_keep, check_row, check_row_length, check_token_room, non_negative, pad_left,
    prefill_leads, zero_prefill_leads)
from .plane_attention import LatentReads, PlaneRow, decoded_reads, planes_attendable, quantized_family


class PagedLatentCache(ReuseFloor):
    """Paged latent state, one ``LatentPages`` per row (see the module docstring)."""

    def __init__(self, geometry: LatentGeometry, format: LatentFormat | None = None, block_size: int = 256) -> None:
        if not isinstance(geometry, LatentGeometry):
            raise InvalidCacheState(f"geometry must be a LatentGeometry (got {type(geometry).__name__})")
        self.geometry = geometry
        self.format = format
        self.block_size = _positive(block_size, "block_size")
        self._codec = FamilyCodec(geometry.widths, format)
        self._minimum = 0
        self._reset()

    def _reset(self) -> None:
        self._rows: list[LatentPages] = []
        self._leading: list[int] = []
        self._ends: list[int] | None = None
        self._prefill_pending = False
        self._round: list[int] | None = None

    # -- identity, layout and accounting -----------------------------------------------------------------------------
    def signature(self) -> str:
        dsa = "dsa:" if self.geometry.has_index else ""
        return f"kv:latent-paged:{dsa}{format_key(self.format)}:{self.block_size}"

    @property
    def batch_size(self) -> int | None:
        return len(self._rows) or None

    @property
    def row_offsets(self) -> list[int]:
        """Each row's stored positions, prefill padding excluded."""
        return [row.offset - lead for row, lead in zip(self._rows, self._leading)]

    @property
    def offset(self) -> int:
        return max((row.offset for row in self._rows), default=0)

    @property
    def left_pad(self) -> list[int]:
        width = self.offset
        return [width - o for o in self.row_offsets]

    @property
    def pages(self) -> list[LatentPages]:
        """Each row's pages (borrowed), in held form: ``persisted_pools`` gives the bytes a snapshot writes."""
        return list(self._rows)

    @property
    def state(self) -> list[mx.array]:
        """Every row's pools in held form (``family_codec``; ``persisted_pools`` gives what a snapshot writes)."""
        return [pool for row in self._rows for pool in row.pools]

    @property
    def persisted_state(self) -> list[mx.array]:
        """``state`` in persisted form (the pools' bytes as a snapshot writes them)."""
        return [pool for row in self._rows for pool in self.persisted_pools(row.pools)]

    def persisted_pools(self, pools: Sequence[mx.array]) -> list[mx.array]:
        """Held pools (``pages[i].pools``) -> the persisted planes' bytes (TurboQuant k8 codes flip back)."""
        return self._codec.stored(pools)

    def held_pools(self, pools: Sequence[mx.array]) -> list[mx.array]:
        """Persisted pools -> the held form ``adopt_rows`` takes (the inverse of ``persisted_pools``)."""
        return self._codec.held(pools)

    def bytes_per_token(self) -> int:
        return self._codec.bytes_per_token()

    def projected_bytes(self, tokens: int) -> int:
        return non_negative(tokens, "tokens") * self.geometry.f32_bytes_per_token()

    def is_trimmable(self) -> bool:
        return True

    # -- the latent contract ----------------------------------------------------------------------------------------
    def append_latent(
        self, latent: mx.array, rope: mx.array, index_keys: mx.array | None = None
    ) -> LatentAttentionState:
        families = self._append(latent, rope, index_keys)
        return LatentAttentionState.of(self._read(self._rows, families))

    def store_latent(self, latent: mx.array, rope: mx.array, index_keys: mx.array | None = None) -> LatentReads:
        """Append like ``append_latent`` but decode nothing: an encoded format attends on each row's gathered pages of
        codes (``plane_attention``); float32 pages read as ``append_latent`` does."""
        self._append(latent, rope, index_keys)
        return self.latent_reads()

    def _append(self, latent: mx.array, rope: mx.array, index_keys: mx.array | None) -> int:
        """Encode and append one step to every row's pages (both appends); returns the family count."""
        families = append_inputs(self.geometry, latent, rope, index_keys, self.batch_size)
        batch, length = latent.shape[0], latent.shape[1]
        offsets = self.row_offsets or [0] * batch
        check_token_room(self.geometry, offsets, length)
        rows = self._rows or [LatentPages(self.block_size) for _ in range(batch)]
        leading = self._leading or [0] * batch
        families = zero_prefill_leads(families, prefill_leads(offsets))
        planes = self._codec.encode(families)
        for b, row in enumerate(rows):  # checked above; the writes cannot fail
            row.append(planes if batch == 1 else [p[b : b + 1] for p in planes])
        self._rows, self._leading = rows, leading
        return len(families)

    def latent_reads(self) -> LatentReads:
        """``LatentReads`` of every stored position: on the gathered pages of codes when the format allows."""
        rows, width = list(self._rows), self.offset
        pads = [width - row.offset for row in rows]
        if not planes_attendable(self.format, self.geometry.widths) or not rows:
            count = len(self.geometry.widths)
            return decoded_reads(LatentAttentionState.of(self._read(rows, count)) if rows else self.read_latent(), pads)
        fmt, codec = self.format, self._codec

        def plane_rows() -> list[PlaneRow]:
            out = []
            for row in rows:
                groups = codec.split(row.gather())
                out.append(PlaneRow(*(quantized_family(fmt, groups[f]) for f in (0, 1))))
            return out

        def decode(family: int) -> mx.array:
            per_row = []
            for row, pad in zip(rows, pads):
                values = codec.decode_family(family, codec.split(row.gather())[family]) if row.offset else \
                    mx.zeros((1, 0, self.geometry.widths[family]), dtype=mx.float32)
                per_row.append(pad_left(values, pad))
            return per_row[0] if len(per_row) == 1 else mx.concatenate(per_row, axis=0)

        return LatentReads(width, pads, decode, plane_rows)

    def attend(
        self, q_latent: mx.array, q_rope: mx.array | None, scale: float, mask: mx.array | None = None
    ) -> mx.array:
        """Absorbed attention over every stored position (``LatentReads.attend``); ``[B, H, L, r]`` float32."""
        return self.latent_reads().attend(q_latent, q_rope, scale, mask)

    def _read(self, rows: Sequence[LatentPages], families: int) -> list[mx.array]:
        """Every row decoded and joined right-justified: per family ``[B, T, W]``."""
        if len(rows) == 1 and rows[0].offset:
            return self._codec.decode(rows[0].gather(), families)
        width = max((row.offset for row in rows), default=0)
        per_row = []
        for row in rows:
            if row.offset:
                decoded = self._codec.decode(row.gather(), families)
                per_row.append([pad_left(d, width - row.offset) for d in decoded])
            else:
                per_row.append([mx.zeros((1, width, w), dtype=mx.float32) for w in self.geometry.widths[:families]])
        return [mx.concatenate([r[f] for r in per_row], axis=0) for f in range(families)]

    def read_latent(self) -> LatentAttentionState:
        """Reads of every stored position without appending (what the last append returned)."""
        reads = self._read(self._rows, len(self.geometry.widths)) if self._rows else [
            mx.zeros((0, 0, w), dtype=mx.float32) for w in self.geometry.widths]
        return LatentAttentionState.of(reads)

    def stored_index_keys(self) -> mx.array | None:
        if not self.geometry.has_index or not self.offset:
            return None
        return self._read(self._rows, 3)[2]

    # -- trim and the speculative transaction ----------------------------------------------------------------------
    def trim(self, n: int) -> int:
        non_negative(n, "trim count")
        if n == 0:
            return 0
        shortest = min(self.row_offsets, default=0)
        if n > shortest:
            raise CacheRangeError(f"cannot trim {n} positions: the shortest row holds {shortest}")
        for row in self._rows:
            row.trim(n)
        return n

    def spec_round_begin(self) -> None:
        self._round = [row.offset for row in self._rows]

    def spec_round_commit(self) -> None:
        self._round = None

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        if self._round is None:
            raise InvalidCacheState("spec_round_rollback without spec_round_begin")
        before = round_start(self._round, len(self._rows))
        appended = [row.offset - b for row, b in zip(self._rows, before)]
        counts = check_keep_counts(keep, appended)
        for row, a, k in zip(self._rows, appended, counts):
            row.trim(a - k)
        self._round = None

    # -- prefill padding -----------------------------------------------------------------------------------------------
    def prepare_prefill(self, padding: PrefillPadding) -> None:
        rows = padding_rows(padding, self.batch_size)
        left = padding.left_padding or [0] * rows
        if any(left) and self.offset > 0:
            raise InvalidCacheState("left padding can only be added to a cache with no stored positions")
        if not self._rows:
            self._rows, self._leading = [LatentPages(self.block_size) for _ in range(rows)], [0] * rows
        self._leading = [lead + p for lead, p in zip(self._leading, left)]
        right = padding.right_padding
        physical = [row.offset for row in self._rows]
        self._ends = [o + n for o, n in zip(physical, padding.lengths)] if right and any(right) else None
        self._prefill_pending = True

    def finalize_prefill(self) -> None:
        if not self._prefill_pending:
            return
        for b, row in enumerate(self._rows):
            end = min(row.offset, self._ends[b]) if self._ends else row.offset
            row.keep(min(self._leading[b], end), end)
        self._leading = [0] * len(self._rows)
        self._ends, self._prefill_pending = None, False

    # -- rows joining and leaving ------------------------------------------------------------------------------------
    def make_empty_batch(self) -> PagedLatentCache:
        return PagedLatentCache(self.geometry, self.format, self.block_size)

    def adopt_rows(self, rows: Sequence[LatentPages]) -> None:
        """Replace this cache's rows with ``rows`` (taking ownership): what extraction and the SSD form restore."""
        rows = list(rows)
        if not rows:
            raise InvalidCacheState("adopt_rows needs at least one row")
        for row in rows:
            if not isinstance(row, LatentPages) or row.block_size != self.block_size:
                raise InvalidCacheState(f"adopt_rows takes LatentPages of block size {self.block_size}")
            if row.pools and len(row.pools) != self._codec.total_planes:
                raise InvalidCacheState(f"pages hold {len(row.pools)} pools, {self.signature()} stores "
                                        f"{self._codec.total_planes} planes")
            for pool, (width, dtype) in zip(row.pools, self._codec.flat_plane_shapes()):
                if pool.shape[2] != width or pool.dtype != dtype:
                    raise InvalidCacheState(f"pool [{pool.shape[0]}, {pool.shape[1]}, {pool.shape[2]}] {pool.dtype} "
                                            f"cannot hold a {width}-wide {dtype} plane of {self.signature()}")
            check_row_length(self.geometry, row.offset)
        self._reset()
        self._rows, self._leading = rows, [0] * len(rows)

    def _require_serial_rows(self, what: str) -> None:
        if self._prefill_pending:
            raise InvalidCacheState(f"{what} needs a finalized prefill; call finalize_prefill() first")

    def merge_rows(self, rows: Sequence[PagedLatentCache]) -> None:
        rows = check_merge_sources(self, rows)
        merged = []
        for source in rows:
            merged.extend([r.clone() for r in source._rows] or [LatentPages(self.block_size)])
        minimum = max(source._minimum for source in rows)
        self.adopt_rows(merged)
        self._minimum = minimum

    def extract_row(self, row: int) -> PagedLatentCache:
        row = check_row(row, self.batch_size)
        self._require_serial_rows("extract_row")
        out = self.make_empty_batch()
        out.adopt_rows([self._rows[row].clone()])
        out._minimum = self._minimum
        return out

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` in order; padding common to the survivors goes (as ``MLACache`` drops it)."""
        keep = check_keep(keep, self.batch_size)
        width = self.offset
        pads = self.left_pad
        drop = min(max(0, min(pads[k] for k in keep)), width)
        new_width = width - drop
        # Rows still holding prefill padding at the front give up the leading positions beyond the new width.
        cut = {k: max(0, self._rows[k].offset - new_width) for k in keep}
        for k in keep:
            if cut[k]:
                self._rows[k].keep(cut[k], self._rows[k].offset)
        self._rows = [self._rows[k] for k in keep]
        self._leading = [self._leading[k] - cut[k] for k in keep]
        if self._ends is not None:
            self._ends = [self._ends[k] - cut[k] for k in keep]
        if self._round is not None:
            self._round = [self._round[k] - cut[k] for k in keep]

    def dispose(self) -> None:
        self._reset()
        self._minimum = 0
