"""``MLACache``: the float32 latent lego, the checkpoint-native compressed-MLA state stored as computed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ...errors import InvalidCacheState
from ..cache_parts import ReuseFloor, extract_one_row, source_row_states
from .columns import ColumnBuffers
from ..contracts import LatentAttentionState
from .geometry import LatentGeometry
from ..justified import RightJustifiedRows
from ..rows import check_f32, check_row, check_row_length, non_negative, pad_left, prefill_leads, zero_prefill_leads
from .plane_attention import LatentReads, decoded_reads


@dataclass
class MLARowState:
    """One row's state with its padding removed: per family (latent, rope[, index]) an owned ``[1, T, w]``."""

    arrays: list[mx.array]
    offset: int
    minimum_reusable_offset: int = 0


class MLACache(ReuseFloor, RightJustifiedRows):
    """float32 latent ``[B, T, kv_lora_rank]``, RoPE key ``[B, T, rope_head_dim]`` and optional DSA index keys.

    Rows are right-justified with zero left padding. Reads are the stored bits, so every other latent lego is
    measured against this one. Each family is held in a buffer with spare columns on the right (``columns.py``):
    an append writes only its new columns, a trim only moves the write head, and a read is a view of the stored
    prefix, so a decode step costs O(1) bytes however many positions are stored.
    """

    def __init__(self, geometry: LatentGeometry) -> None:
        super().__init__(geometry)
        self._columns = ColumnBuffers()
        self._minimum = 0

    # -- identity and accounting -----------------------------------------------------------------------------------
    def signature(self) -> str:
        return "kv:mla:target:dsa" if self.geometry.has_index else "kv:mla:target"

    @property
    def state(self) -> list[mx.array]:
        """Per family the stored positions ``[B, offset, w]`` (views; the spare capacity is never exposed)."""
        return self._columns.views()

    @property
    def nbytes(self) -> int:
        """Bytes held, spare capacity included."""
        return self._columns.nbytes

    def bytes_per_token(self) -> int:
        return self.geometry.f32_bytes_per_token()

    def projected_bytes(self, tokens: int) -> int:
        return non_negative(tokens, "tokens") * self.geometry.f32_bytes_per_token()

    # -- layout hooks ----------------------------------------------------------------------------------------------
    def _stored(self) -> list[mx.array]:
        return self._columns.views()

    def _publish(self, arrays: list[mx.array]) -> None:
        self._edited()
        self._columns.adopt(arrays)

    def _truncate(self, width: int) -> None:
        self._columns.truncate(width)

    # -- the latent contract ---------------------------------------------------------------------------------------
    def append_latent(
        self, latent: mx.array, rope: mx.array, index_keys: mx.array | None = None
    ) -> LatentAttentionState:
        families, batch, length = self._check_append(latent, rope, index_keys)
        if self._batch is None:
            self._begin_rows(batch)
        leads = prefill_leads(self._offsets)
        if any(leads):
            families = zero_prefill_leads(families, leads)
        self._columns.write(families, self._width)
        self._width += length
        self._offsets = [o + length for o in self._offsets]
        return self._read()

    def store_latent(self, latent: mx.array, rope: mx.array, index_keys: mx.array | None = None) -> LatentReads:
        """``append_latent`` with its reads as ``LatentReads`` (float32 storage: the reads are the stored bits)."""
        return decoded_reads(self.append_latent(latent, rope, index_keys), self.left_pad)

    def latent_reads(self) -> LatentReads:
        return decoded_reads(self.read_latent(), self.left_pad if self._batch is not None else [])

    def attend(
        self, q_latent: mx.array, q_rope: mx.array | None, scale: float, mask: mx.array | None = None
    ) -> mx.array:
        """Absorbed attention over every stored position (``LatentReads.attend``); ``[B, H, L, r]`` float32."""
        return self.latent_reads().attend(q_latent, q_rope, scale, mask)

    def _read(self) -> LatentAttentionState:
        return LatentAttentionState.of(self._columns.views())

    def read_latent(self) -> LatentAttentionState:
        """Reads of every stored position without appending (what the last append returned)."""
        if not self._columns:
            batch = self._batch or 0
            zeros = [mx.zeros((batch, 0, w), dtype=mx.float32) for w in self.geometry.widths]
            return LatentAttentionState.of(zeros)
        return self._read()

    def stored_index_keys(self) -> mx.array | None:
        if not self.geometry.has_index or not self._columns:
            return None
        return self._columns.views()[2]

    # -- rows joining and leaving ------------------------------------------------------------------------------------
    def make_empty_batch(self) -> MLACache:
        return MLACache(self.geometry)

    def row_state(self, row: int) -> MLARowState:
        """Owned copies of row ``row`` with its padding removed."""
        row = check_row(row, self._batch)
        self._require_serial_rows("row_state")
        start = self._width - self._offsets[row]
        if self._columns:
            arrays = [a[row : row + 1, start:, :] for a in self._columns.views()]
        else:
            arrays = [mx.zeros((1, 0, w), dtype=mx.float32) for w in self.geometry.widths]
        return MLARowState(arrays, self._offsets[row], self._minimum)

    def _check_state(self, state: MLARowState) -> None:
        if not isinstance(state, MLARowState):
            raise InvalidCacheState(f"expected an MLARowState (got {type(state).__name__})")
        offset = non_negative(state.offset, "row state offset")
        non_negative(state.minimum_reusable_offset, "row state minimum_reusable_offset")
        widths = self.geometry.widths
        if len(state.arrays) != len(widths):
            raise InvalidCacheState(f"row state has {len(state.arrays)} families, geometry has {len(widths)}")
        for name, array, width in zip(("latent", "rope key", "index keys"), state.arrays, widths):
            check_f32(f"row state {name}", array, (1, offset, width))
        check_row_length(self.geometry, offset)

    def merge_row_states(self, states: Sequence[MLARowState]) -> None:
        """Fill this EMPTY cache with ``states`` as rows (right-justified, zero left padding)."""
        states = self._states_to_merge(states)
        width = max(s.offset for s in states)
        families = []
        if width:
            for f in range(len(self.geometry.widths)):
                families.append(mx.concatenate([pad_left(s.arrays[f], width - s.offset) for s in states], axis=0))
        self._begin_rows(len(states))
        self._columns.adopt(families)
        self._width = width
        self._offsets = [s.offset for s in states]
        self._minimum = max(s.minimum_reusable_offset for s in states)

    def adopt_batch(self, families: Sequence[mx.array], offsets: Sequence[int], minimum: int) -> None:
        """Take ``families`` (``[B, max(offsets), w]`` each, rows right-justified, zeros in the left padding) as this
        EMPTY cache's rows, without copying: what ``merge_row_states`` builds, when the caller (the store's batched
        restore) already wrote the rows into place."""
        if self._batch is not None:
            raise InvalidCacheState("adopt_batch needs an empty destination cache")
        offsets = [non_negative(o, "row offset") for o in offsets]
        if not offsets:
            raise InvalidCacheState("adopt_batch needs at least one row")
        width = max(offsets)
        check_row_length(self.geometry, width)
        families = list(families)
        if len(families) != len(self.geometry.widths):
            raise InvalidCacheState(f"adopt_batch got {len(families)} families, geometry has {len(self.geometry.widths)}")
        for name, array, w in zip(("latent", "rope key", "index keys"), families, self.geometry.widths):
            check_f32(f"batched {name}", array, (len(offsets), width, w))
        self._begin_rows(len(offsets))
        self._columns.adopt(families if width else [])
        self._width = width
        self._offsets = offsets
        self._minimum = non_negative(minimum, "minimum_reusable_offset")

    def merge_rows(self, rows: Sequence[MLACache]) -> None:
        """Rows of every source, in order (an empty source contributes one zero-length row); sources unchanged."""
        def empty(_: MLACache) -> MLARowState:
            return MLARowState([mx.zeros((1, 0, w)) for w in self.geometry.widths], 0, 0)

        self.merge_row_states(source_row_states(self._check_merge_sources(rows), empty))

    def extract_row(self, row: int) -> MLACache:
        return extract_one_row(self, row)

    def dispose(self) -> None:
        self._reset_rows()
        self._columns.clear()
        self._minimum = 0
