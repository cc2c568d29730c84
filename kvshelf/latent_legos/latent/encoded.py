"""``EncodedLatentCache``: the latent state stored affine- or TurboQuant-encoded, float32 first.

Every append encodes its positions into each family's planes. A row reads its float32 shadow through the append
that leaves it holding at least ``start`` positions (its first append when ``start`` is 0), then converts, for
good: trimming or rolling back below ``start`` keeps it converted. A conversion at a nonzero ``start`` records
the row's offset as its ``minimum_reusable_offset`` (shorter prefixes were never stored encoded-only). The
shadow ``[B, T, W]`` per family exists only while some row is unconverted.

Planes and shadow sit in buffers with spare columns on the right (``columns.py``), so an append encodes and writes
only its new positions. A read decodes the stored planes (the one cost an encoded read cannot avoid) unless the
cache was built with ``read_buffer=True``: then, while every row is converted, it keeps the decoded float32 reads
in a buffer of their own and decodes only the positions appended since the last read (rebuilt after a relayout,
filter or merge). The buffer costs 4 bytes a value (about 3.5x the planes at affine 8, 4x at turbo k8) on top of
the planes, which is why it is an option and off by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ...errors import InvalidCacheState
from ..cache_parts import extract_one_row, source_row_states
from .columns import ColumnBuffers
from ..contracts import LatentAttentionState
from .family_codec import FamilyCodec
from ..formats import LatentFormat, format_key
from .geometry import LatentGeometry
from ..justified import RightJustifiedRows
from ..rows import (check_f32, check_row, check_row_length, non_negative, pad_left, pick_rows, prefill_leads,
    transition_due, zero_leading, zero_prefill_leads)
from .plane_attention import LatentReads, PlaneRow, decoded_reads, planes_attendable, quantized_family


@dataclass
class EncodedRowState:
    """One row with its padding removed: per family its planes ``[1, T, w_i]``; the f32 shadow per family
    ``[1, T, W]`` while the row is unconverted (``None`` once converted)."""

    planes: list[list[mx.array]]
    shadow: list[mx.array] | None
    offset: int
    minimum_reusable_offset: int = 0


class EncodedLatentCache(RightJustifiedRows):
    """Encoded latent state, right-justified rows like ``MLACache`` (see the module docstring)."""

    def __init__(
        self, geometry: LatentGeometry, format: LatentFormat, start: int = 0, read_buffer: bool = False
    ) -> None:
        super().__init__(geometry)
        if format is None:
            raise InvalidCacheState("EncodedLatentCache needs a format (use MLACache for float32)")
        if not isinstance(read_buffer, bool):
            raise InvalidCacheState(f"read_buffer must be a bool (got {read_buffer!r})")
        self.format = format
        self.start = non_negative(start, "quantized_kv_start")
        self.read_buffer = read_buffer
        self._codec = FamilyCodec(geometry.widths, format)
        self._planes = ColumnBuffers()  # flat, family-major
        self._shadow: ColumnBuffers | None = None
        self._decoded: ColumnBuffers | None = None  # the read buffer (read_buffer=True, every row converted)
        self._converted: list[bool] = []
        self._minimum: list[int] = []
        self._unrowed_minimum = 0

    # -- identity and accounting -----------------------------------------------------------------------------------
    def signature(self) -> str:
        dsa = "dsa:" if self.geometry.has_index else ""
        return f"kv:latent:{dsa}{format_key(self.format)}:{self.start}"

    @property
    def state(self) -> list[mx.array]:
        """The held planes (then the shadow), ``[B, offset, w]`` views; spare capacity is never exposed. Held, not
        persisted, form (``family_codec``): what a snapshot writes goes through ``row_state``."""
        return self._stored()

    @property
    def persisted_state(self) -> list[mx.array]:
        """``state`` in persisted form: the planes as the encoding writes them (TurboQuant k8 codes flipped back),
        then the shadow — the bytes a snapshot of this cache stores."""
        planes = self._codec.stored(self._planes.views()) if self._planes else []
        return [*planes, *(self._shadow.views() if self._shadow is not None else [])]

    @property
    def nbytes(self) -> int:
        """Bytes held: planes, shadow and read buffer, spare capacity included."""
        held = self._planes.nbytes + (self._shadow.nbytes if self._shadow is not None else 0)
        return held + (self._decoded.nbytes if self._decoded is not None else 0)

    @property
    def converted(self) -> list[bool]:
        """Per row, whether it reads its encoded planes (True) or still its f32 shadow."""
        return list(self._converted)

    @property
    def minimum_reusable_offset(self) -> int:
        return max(self._minimum, default=self._unrowed_minimum)

    @minimum_reusable_offset.setter
    def minimum_reusable_offset(self, value: int) -> None:
        value = non_negative(value, "minimum_reusable_offset")
        self._minimum = [value] * len(self._minimum)
        self._unrowed_minimum = value
        self._edited()

    def bytes_per_token(self) -> int:
        """Encoded bytes of one position (the shadow is transient and not counted)."""
        return self._codec.bytes_per_token()

    def projected_bytes(self, tokens: int) -> int:
        """Admission estimate: float32 (conservative, the shadow may be held as well)."""
        return non_negative(tokens, "tokens") * self.geometry.f32_bytes_per_token()

    # -- layout hooks ----------------------------------------------------------------------------------------------
    def _stored(self) -> list[mx.array]:
        return [*self._planes.views(), *(self._shadow.views() if self._shadow is not None else [])]

    def _publish(self, arrays: list[mx.array]) -> None:
        self._edited()
        count = self._codec.total_planes
        self._planes.adopt(arrays[:count])
        self._shadow = _held(arrays[count:]) if len(arrays) > count else None
        self._decoded = None

    def _truncate(self, width: int) -> None:
        for buffers in (self._planes, self._shadow, self._decoded):
            if buffers is not None:
                buffers.truncate(width)
        if not width:
            self._shadow = None

    def _create_rows(self, batch: int) -> None:
        self._converted = [False] * batch
        self._minimum = [self._unrowed_minimum] * batch

    def _select_rows(self, keep: list[int]) -> None:
        self._edited()
        self._converted = [self._converted[k] for k in keep]
        self._minimum = [self._minimum[k] for k in keep]
        self._drop_shadow_if_converted()

    def _drop_shadow_if_converted(self) -> None:
        if self._shadow is not None and all(self._converted):
            self._edited()  # the shadow slots leave the snapshot
            self._shadow = None

    # -- the latent contract ---------------------------------------------------------------------------------------
    def append_latent(
        self, latent: mx.array, rope: mx.array, index_keys: mx.array | None = None
    ) -> LatentAttentionState:
        return self._append(latent, rope, index_keys, on_planes=False)

    def store_latent(self, latent: mx.array, rope: mx.array, index_keys: mx.array | None = None) -> LatentReads:
        """Append like ``append_latent``, but decode nothing: when every row read its encoded planes before this
        append, the returned ``LatentReads`` attends on the planes (``plane_attention``); rows still reading their
        float32 shadow get ``append_latent``'s reads, bit for bit."""
        return self._append(latent, rope, index_keys, on_planes=True)

    def attend(
        self, q_latent: mx.array, q_rope: mx.array | None, scale: float, mask: mx.array | None = None
    ) -> mx.array:
        """Absorbed attention over every stored position (``LatentReads.attend``), on the planes once every row is
        converted; ``[B, H, L, r]`` float32."""
        return self.latent_reads().attend(q_latent, q_rope, scale, mask)

    def latent_reads(self) -> LatentReads:
        """``LatentReads`` of every stored position (on the planes when every row is converted)."""
        if self._planes and self._shadow is None and all(self._converted):
            return self._plane_reads(self._width, list(self._offsets))
        return decoded_reads(self.read_latent(), self.left_pad if self._batch is not None else [])

    def _plane_reads(self, width: int, offsets: list[int], decoded: list[mx.array] | None = None,
                     which: list[bool] | None = None) -> LatentReads:
        """Reads of the first ``width`` stored columns, rows ending there with ``offsets`` positions each, that
        attend on the planes. The views are taken when asked for, so nothing here holds a buffer across an append.
        A mixed batch (``which``: rows on planes) carries its ``decoded`` reads (today's) as well."""
        fmt, codec = self.format, self._codec
        pads = [width - o for o in offsets]

        def rows() -> list[PlaneRow | None]:
            groups = codec.split([p[:, :width, :] for p in self._planes.views()])
            out = []
            for b, pad in enumerate(pads):
                if which is not None and not which[b]:
                    out.append(None)
                    continue
                latent, rope = (quantized_family(fmt, [p[b : b + 1, pad:, :] for p in groups[f]]) for f in (0, 1))
                out.append(PlaneRow(latent, rope))
            return out

        if decoded is not None:
            return LatentReads(width, pads, lambda family: decoded[family], rows, which)

        def decode(family: int) -> mx.array:
            group = codec.split([p[:, :width, :] for p in self._planes.views()])[family]
            return zero_leading([codec.decode_family(family, group)], pads)[0]

        return LatentReads(width, pads, decode, rows)

    def _append(
        self, latent: mx.array, rope: mx.array, index_keys: mx.array | None, on_planes: bool
    ) -> LatentAttentionState | LatentReads:
        families, batch, length = self._check_append(latent, rope, index_keys)
        offsets = self._offsets if self._batch is not None else [0] * batch
        converted = self._converted if self._batch is not None else [False] * batch
        leads = prefill_leads(offsets)
        if any(leads):
            families = zero_prefill_leads(families, leads)
        planes = self._codec.encode(families)
        new_offsets = [o + length for o in offsets]
        # Publish: nothing below can fail.
        if self._batch is None:
            self._begin_rows(batch)
        at = self._width
        self._planes.write(planes, at)
        if not all(converted):
            if self._shadow is None:
                self._shadow = ColumnBuffers()
            self._shadow.write(families, at)
        else:
            self._shadow = None
        planes_now = on_planes and self._batch_ready(batch) and all(converted) and self._shadow is None
        if planes_now and planes_attendable(self.format, self.geometry.widths):
            reads = self._plane_reads(at + length, new_offsets)
        else:
            reads = self._read(self._stored_planes(), self._stored_shadow(), converted,
                               [at + length - o for o in new_offsets])
            if on_planes and self._batch_ready(batch) and any(converted) \
                    and planes_attendable(self.format, self.geometry.widths):
                reads = self._plane_reads(at + length, new_offsets, reads, list(converted))
            elif on_planes:
                reads = decoded_reads(LatentAttentionState.of(reads), [at + length - o for o in new_offsets])
        self._width += length
        self._offsets = new_offsets
        for row, offset in enumerate(new_offsets):
            if not self._converted[row] and transition_due(offset, self.start):
                self._edited()  # the row now reads (and snapshots) its planes only
                self._converted[row] = True
                if self.start > 0:
                    self._minimum[row] = offset
        self._drop_shadow_if_converted()
        return reads if isinstance(reads, LatentReads) else LatentAttentionState.of(reads)

    def _batch_ready(self, batch: int) -> bool:
        return self._batch is not None and len(self._converted) == batch

    def _stored_planes(self) -> list[mx.array]:
        return self._planes.views()

    def _stored_shadow(self) -> list[mx.array] | None:
        return self._shadow.views() if self._shadow is not None else None

    def _read(
        self,
        planes: list[mx.array],
        shadow: list[mx.array] | None,
        converted: Sequence[bool],
        pads: Sequence[int],
        families: int | None = None,
    ) -> list[mx.array]:
        """Per family ``[B, T, W]``: decoded planes for converted rows, the shadow for the rest, zeros in padding."""
        if shadow is None and self.read_buffer and all(converted):
            decoded = self._buffered_reads(planes)[: families if families is not None else len(self.geometry.widths)]
            return zero_leading(decoded, pads)
        self._decoded = None
        decoded = self._codec.decode(planes, families)
        if shadow is not None:
            decoded = [pick_rows(converted, d, s) for d, s in zip(decoded, shadow)]
        return zero_leading(decoded, pads)

    def _buffered_reads(self, planes: list[mx.array]) -> list[mx.array]:
        """The decoded reads of ``planes`` (every stored column) through the read buffer: only the columns appended
        since the buffer last caught up are decoded; decoding is per position, so the bits are those of a whole
        decode."""
        width = planes[0].shape[1]
        buffered = self._decoded
        if buffered is None or buffered.width > width:
            buffered = self._decoded = ColumnBuffers()
        if buffered.width < width:
            fresh = self._codec.decode([p[:, buffered.width :, :] for p in planes])
            buffered.write(fresh, buffered.width)
        return buffered.views()

    def read_latent(self) -> LatentAttentionState:
        """Reads of every stored position without appending (what the last append returned)."""
        if not self._planes:
            batch = self._batch or 0
            zeros = [mx.zeros((batch, 0, w), dtype=mx.float32) for w in self.geometry.widths]
            return LatentAttentionState.of(zeros)
        reads = self._read(self._stored_planes(), self._stored_shadow(), self._converted, self.left_pad)
        return LatentAttentionState.of(reads)

    def stored_index_keys(self) -> mx.array | None:
        if not self.geometry.has_index or not self._planes:
            return None
        return self.read_latent().index_keys

    # -- rows joining and leaving ------------------------------------------------------------------------------------
    def make_empty_batch(self) -> EncodedLatentCache:
        return EncodedLatentCache(self.geometry, self.format, self.start, self.read_buffer)

    def row_state(self, row: int) -> EncodedRowState:
        """Owned copies of row ``row`` with its padding removed."""
        row = check_row(row, self._batch)
        self._require_serial_rows("row_state")
        start, offset = self._width - self._offsets[row], self._offsets[row]
        if self._planes:
            planes = self._codec.split(self._codec.stored([p[row : row + 1, start:, :] for p in self._planes.views()]))
        else:
            planes = self._codec.empty_planes(1)
        shadow = None
        if not self._converted[row]:
            if self._shadow:
                shadow = [s[row : row + 1, start:, :] for s in self._shadow.views()]
            else:
                shadow = [mx.zeros((1, 0, w), dtype=mx.float32) for w in self.geometry.widths]
        return EncodedRowState(planes, shadow, offset, self._minimum[row])

    def _check_state(self, state: EncodedRowState) -> None:
        if not isinstance(state, EncodedRowState):
            raise InvalidCacheState(f"expected an EncodedRowState (got {type(state).__name__})")
        offset = non_negative(state.offset, "row state offset")
        non_negative(state.minimum_reusable_offset, "row state minimum_reusable_offset")
        check_row_length(self.geometry, offset)
        shapes = self._codec.plane_shapes()
        if not (offset == 0 and not state.planes):
            if len(state.planes) != len(shapes):
                raise InvalidCacheState(f"row state has {len(state.planes)} families, geometry has {len(shapes)}")
            for family, (group, (widths, dtypes)) in enumerate(zip(state.planes, shapes)):
                if len(group) != len(widths):
                    raise InvalidCacheState(f"family {family} has {len(group)} planes, {self.signature()} "
                                            f"stores {len(widths)}")
                for plane, width, dtype in zip(group, widths, dtypes):
                    if not isinstance(plane, mx.array) or tuple(plane.shape) != (1, offset, width):
                        got = tuple(plane.shape) if isinstance(plane, mx.array) else type(plane).__name__
                        raise InvalidCacheState(f"family {family} plane shape {got} != {(1, offset, width)}")
                    if plane.dtype != dtype:
                        raise InvalidCacheState(f"family {family} plane dtype {plane.dtype} != {dtype}")
        if state.shadow is not None and not (offset == 0 and not state.shadow):
            if len(state.shadow) != len(self.geometry.widths):
                raise InvalidCacheState(f"row state shadow has {len(state.shadow)} families, "
                                        f"geometry has {len(self.geometry.widths)}")
            for family, (values, width) in enumerate(zip(state.shadow, self.geometry.widths)):
                check_f32(f"shadow family {family}", values, (1, offset, width))

    def merge_row_states(self, states: Sequence[EncodedRowState]) -> None:
        """Fill this EMPTY cache with ``states`` as rows (right-justified, zero left padding); the shadow is kept
        iff some row is unconverted, converted rows' shadow holding zeros."""
        states = self._states_to_merge(states)
        width = max(s.offset for s in states)
        converted = [s.shadow is None for s in states]
        planes, shadow = [], None
        if width:
            flat = [self._codec.held(self._codec.split_flat(s.planes)) for s in states]
            for i, (w, dtype) in enumerate(self._codec.flat_plane_shapes()):
                rows = [pad_left(f[i], width - s.offset) if s.offset else mx.zeros((1, width, w), dtype=dtype)
                        for s, f in zip(states, flat)]
                planes.append(mx.concatenate(rows, axis=0))
            if not all(converted):
                shadow = []
                for f, w in enumerate(self.geometry.widths):
                    rows = [pad_left(s.shadow[f], width - s.offset) if s.shadow and s.offset
                            else mx.zeros((1, width, w), dtype=mx.float32) for s in states]
                    shadow.append(mx.concatenate(rows, axis=0))
        self._begin_rows(len(states))
        self._publish([*planes, *(shadow or [])])
        self._width = width
        self._offsets = [s.offset for s in states]
        self._converted = converted
        self._minimum = [s.minimum_reusable_offset for s in states]

    def adopt_batch(
        self,
        planes: Sequence[mx.array],
        shadow: Sequence[mx.array] | None,
        offsets: Sequence[int],
        converted: Sequence[bool],
        minimums: Sequence[int],
    ) -> None:
        """Take flat ``planes`` (and the f32 ``shadow`` iff some row is unconverted), each ``[B, max(offsets), w]``
        with rows right-justified and zeros elsewhere (converted rows' shadow too), as this EMPTY cache's rows,
        without copying: what ``merge_row_states`` builds, when the store's batched restore wrote rows in place."""
        if self._batch is not None:
            raise InvalidCacheState("adopt_batch needs an empty destination cache")
        offsets = [non_negative(o, "row offset") for o in offsets]
        rows = len(offsets)
        if not rows or len(converted) != rows or len(minimums) != rows:
            raise InvalidCacheState(f"adopt_batch needs one offset, converted flag and floor per row (got {rows}, "
                                    f"{len(converted)}, {len(minimums)})")
        width = max(offsets)
        check_row_length(self.geometry, width)
        shapes = self._codec.flat_plane_shapes()
        planes = list(planes)
        if len(planes) != len(shapes):
            raise InvalidCacheState(f"adopt_batch got {len(planes)} planes, {self.signature()} stores {len(shapes)}")
        for i, (plane, (w, dtype)) in enumerate(zip(planes, shapes)):
            if tuple(plane.shape) != (rows, width, w) or plane.dtype != dtype:
                raise InvalidCacheState(f"batched plane {i} is {list(plane.shape)} {plane.dtype}; expected "
                                        f"{[rows, width, w]} {dtype}")
        converted = [bool(c) for c in converted]
        if all(converted) != (shadow is None):
            raise InvalidCacheState("adopt_batch needs a shadow exactly when some row is unconverted")
        if shadow is not None:
            shadow = list(shadow)
            if len(shadow) != len(self.geometry.widths):
                raise InvalidCacheState(f"batched shadow has {len(shadow)} families, geometry has "
                                        f"{len(self.geometry.widths)}")
            for f, (values, w) in enumerate(zip(shadow, self.geometry.widths)):
                check_f32(f"batched shadow family {f}", values, (rows, width, w))
        minimums = [non_negative(m, "minimum_reusable_offset") for m in minimums]
        self._begin_rows(rows)
        if width and self._codec.flips_codes:  # held form; the left padding stays zero bytes, as merge_row_states
            planes = zero_leading(self._codec.held(planes), [width - o for o in offsets])  # leaves it
        self._publish([*planes, *(shadow or [])] if width else [])
        self._width, self._offsets = width, offsets
        self._converted, self._minimum = converted, minimums

    def merge_rows(self, rows: Sequence[EncodedLatentCache]) -> None:
        """Rows of every source, in order (an empty source contributes one zero-length unconverted row)."""
        def empty(source: EncodedLatentCache) -> EncodedRowState:
            shadow = [mx.zeros((1, 0, w), dtype=mx.float32) for w in self.geometry.widths]
            return EncodedRowState(self._codec.empty_planes(1), shadow, 0, source._unrowed_minimum)

        self.merge_row_states(source_row_states(self._check_merge_sources(rows), empty))

    def extract_row(self, row: int) -> EncodedLatentCache:
        return extract_one_row(self, row)

    def dispose(self) -> None:
        self._reset_rows()
        self._planes.clear()
        self._shadow = self._decoded = None
        self._converted, self._minimum, self._unrowed_minimum = [], [], 0


def _held(arrays: Sequence[mx.array]) -> ColumnBuffers:
    held = ColumnBuffers()
    held.adopt(arrays)
    return held
