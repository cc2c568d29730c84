"""Encode and decode the latent families (latent, rope[, index]) of one geometry under one format.

``None`` stores plain float32 (one plane per family, the input itself). The encodings come from
``encodings.family_encoding`` (imported on first use so the f32 legos never need them).

Every encoding works in groups along the last axis and every family width is a whole number of groups, so the
families of a short append (a decode step) are encoded in one pass over their concatenation and the planes cut back
per family: the same bits as encoding each family alone, with half the (per-operation dominated) cost of a step.

Held form and stored form: TurboQuant's 8-bit key codes are signed (int8), while ``mx.quantized_matmul`` reads
unsigned codes. A cache therefore holds them *held*: the same int8 plane with the top bit of every code flipped, so
its bytes viewed as uint8 are the offset-binary codes ``idx + 128`` that attention on the planes reads in place
(``plane_attention``), with no per-step copy of the codes. ``encode`` returns and ``decode`` takes the held form;
whatever leaves or enters a cache as persisted planes (row states, batched restores, pages written to or read from
a snapshot) passes ``stored``/``held``, which flip the bit back (the flip is its own inverse, so the persisted bytes
are exactly the encoding's). Every other format's held form is its stored form.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ...errors import InvalidCacheState
from ..formats import AffineFormat, LatentFormat, TurboFormat

_TOP_BIT = mx.array(0x80, dtype=mx.uint8)
JOINT_MAX_POSITIONS = 256  # longer appends encode per family (the concatenation would copy a whole prefill)


class FamilyCodec:
    """Per family its encoding; flat plane lists are family-major (every plane of family 0, then family 1, ...)."""

    def __init__(self, widths: Sequence[int], fmt: LatentFormat | None) -> None:
        if fmt is not None and not isinstance(fmt, (AffineFormat, TurboFormat)):
            raise InvalidCacheState(f"latent format must be AffineFormat, TurboFormat or None (got {fmt!r})")
        self.widths = tuple(widths)
        self.format = fmt
        self._joint = None
        if fmt is None:
            self.encodings = None
            self.plane_counts = [1] * len(self.widths)
        else:
            from ..encodings.family import family_encoding

            self.encodings = [family_encoding(fmt, w) for w in self.widths]
            self.plane_counts = [e.planes for e in self.encodings]
            if len(self.widths) > 1:
                self._joint = family_encoding(fmt, sum(self.widths))
                self._cuts = self._joint_cuts()
        self._bytes_per_token: int | None = None

    def _joint_cuts(self) -> list[tuple[int, int, int]]:
        """Flat plane order -> (joint plane index, start, stop) on the joint planes' last axis."""
        cuts, starts = [], [0] * self._joint.planes
        for enc in self.encodings:
            for i, width in enumerate(enc.plane_widths()):
                cuts.append((i, starts[i], starts[i] + width))
                starts[i] += width
        return cuts

    @property
    def flips_codes(self) -> bool:
        """Whether the held form differs from the stored form (TurboQuant at 8 key bits)."""
        return isinstance(self.format, TurboFormat) and self.format.k_bits == 8

    def _flip(self, planes: Sequence[mx.array]) -> list[mx.array]:
        """Every family's code plane with its top bits flipped (int8 stays int8)."""
        if not self.flips_codes:
            return list(planes)
        out, at = list(planes), 0
        for count in self.plane_counts:
            codes = out[at]
            out[at] = (codes.view(mx.uint8) ^ _TOP_BIT).view(mx.int8)
            at += count
        return out

    def held(self, planes: Sequence[mx.array]) -> list[mx.array]:
        """Stored (persisted) flat planes -> the form a cache holds (see the module docstring)."""
        return self._flip(planes)

    def stored(self, planes: Sequence[mx.array]) -> list[mx.array]:
        """Held flat planes -> the persisted form (the encoding's own bytes)."""
        return self._flip(planes)

    def held_family(self, family: int, group: Sequence[mx.array]) -> list[mx.array]:
        """One family's stored planes -> held (a family's code plane is its first)."""
        if not self.flips_codes:
            return list(group)
        return [(group[0].view(mx.uint8) ^ _TOP_BIT).view(mx.int8), *group[1:]]

    def decode_family(self, family: int, group: Sequence[mx.array]) -> mx.array:
        """One family's held planes decoded, ``[B, L, W_family]`` float32."""
        return self.encodings[family].decode(self.held_family(family, group))  # the flip is its own inverse

    @property
    def total_planes(self) -> int:
        return sum(self.plane_counts)

    def encode(self, families: Sequence[mx.array]) -> list[mx.array]:
        """f32 ``[B, L, W_f]`` per family -> the flat plane list."""
        if self.encodings is None:
            return list(families)
        if self._joint is not None and len(families) == len(self.widths) and families[0].shape[1] <= JOINT_MAX_POSITIONS:
            joint = self._joint.encode(mx.concatenate(list(families), axis=-1))
            if self.flips_codes:
                joint = [(joint[0].view(mx.uint8) ^ _TOP_BIT).view(mx.int8), *joint[1:]]
            return [joint[i][..., start:stop] for i, start, stop in self._cuts]
        return self.held([plane for enc, values in zip(self.encodings, families) for plane in enc.encode(values)])

    def split(self, planes: Sequence[mx.array]) -> list[list[mx.array]]:
        """The flat plane list grouped per family."""
        out, at = [], 0
        for count in self.plane_counts:
            out.append(list(planes[at : at + count]))
            at += count
        return out

    @staticmethod
    def split_flat(groups: Sequence[Sequence[mx.array]]) -> list[mx.array]:
        """Per-family plane groups flattened (the inverse of ``split``)."""
        return [plane for group in groups for plane in group]

    def decode(self, planes: Sequence[mx.array], families: int | None = None) -> list[mx.array]:
        """The held flat plane list -> f32 ``[B, L, W_f]`` per family (the first ``families`` only, if given)."""
        groups = self.split(planes)[: families if families is not None else len(self.widths)]
        if self.encodings is None:
            return [g[0] for g in groups]
        return [self.decode_family(f, g) for f, g in enumerate(groups)]

    def plane_shapes(self) -> list[tuple[tuple[int, ...], list[mx.Dtype]]]:
        """Per family, its planes' widths and dtypes."""
        if self.encodings is None:
            return [((w,), [mx.float32]) for w in self.widths]
        return [(tuple(e.plane_widths()), list(e.plane_dtypes())) for e in self.encodings]

    def flat_plane_shapes(self) -> list[tuple[int, mx.Dtype]]:
        """Width and dtype of every stored plane, in flat (family-major) order."""
        return [(w, d) for widths, dtypes in self.plane_shapes() for w, d in zip(widths, dtypes)]

    def empty_planes(self, batch: int) -> list[list[mx.array]]:
        """Per family, zero-length planes ``[batch, 0, w_i]``."""
        return [[mx.zeros((batch, 0, w), dtype=d) for w, d in zip(widths, dtypes)]
                for widths, dtypes in self.plane_shapes()]

    def bytes_per_token(self) -> int:
        """Stored bytes of one position: the encoded planes of one token, or 4 bytes a value in f32."""
        if self._bytes_per_token is None:
            if self.encodings is None:
                self._bytes_per_token = 4 * sum(self.widths)
            else:
                probe = self.encode([mx.zeros((1, 1, w), dtype=mx.float32) for w in self.widths])
                self._bytes_per_token = sum(p.nbytes for p in probe)
        return self._bytes_per_token
