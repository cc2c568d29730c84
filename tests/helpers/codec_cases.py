"""Shared builders for the codec tests: every latent lego, filled with deterministic random state."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kvshelf.latent_legos import AffineFormat, EncodedLatentCache, LatentGeometry, MLACache, PagedLatentCache, TurboFormat

GEOMETRY = LatentGeometry(kv_lora_rank=64, rope_head_dim=32)
GEOMETRY_DSA = LatentGeometry(kv_lora_rank=64, rope_head_dim=32, index_head_dim=32, max_tokens=64)

FORMATS = {
    "f32": None,
    "affine8": AffineFormat(bits=8, group_size=32),
    "affine4": AffineFormat(bits=4, group_size=32),
    "turbo8": TurboFormat(k_bits=8, v_bits=3),
    "turbo4": TurboFormat(k_bits=4, v_bits=3),
}


@dataclass(frozen=True)
class Case:
    lego: str  # "mla" | "encoded" | "paged"
    fmt: str
    dsa: bool
    converted: bool  # encoded only: start reached (planes only) or not (f32 shadow kept)
    block_size: int = 4

    @property
    def id(self) -> str:
        conv = "" if self.lego != "encoded" else ("-converted" if self.converted else "-unconverted")
        return f"{self.lego}-{self.fmt}-{'dsa' if self.dsa else 'nodsa'}{conv}"

    def geometry(self) -> LatentGeometry:
        return GEOMETRY_DSA if self.dsa else GEOMETRY

    def make(self):
        g, fmt = self.geometry(), FORMATS[self.fmt]
        if self.lego == "mla":
            return MLACache(g)
        if self.lego == "encoded":
            return EncodedLatentCache(g, fmt, 3 if self.converted else 40)
        return PagedLatentCache(g, fmt, self.block_size)


def all_cases() -> list[Case]:
    cases = []
    for dsa in (False, True):
        cases.append(Case("mla", "f32", dsa, False))
        for fmt in FORMATS:
            cases.append(Case("paged", fmt, dsa, False))
            if fmt != "f32":
                for converted in (False, True):
                    cases.append(Case("encoded", fmt, dsa, converted))
    return cases


def inputs(geometry: LatentGeometry, length: int, seed: int, batch: int = 1):
    """Deterministic f32 latent, rope and (DSA) index keys ``[batch, length, w]``."""
    rng = np.random.default_rng(seed)
    arrays = [mx.array(rng.standard_normal((batch, length, w)).astype(np.float32)) for w in geometry.widths]
    return arrays[0], arrays[1], arrays[2] if geometry.has_index else None


def append(cache, length: int, seed: int, batch: int = 1):
    latent, rope, index = inputs(cache.geometry, length, seed, batch)
    return cache.append_latent(latent, rope, index)


def filled(case: Case, lengths=(5, 3), seed: int = 0):
    cache = case.make()
    for i, length in enumerate(lengths):
        append(cache, length, seed + i)
    return cache


def bits(array) -> bytes:
    """The exact bytes of an array (NaN-safe, sign-of-zero-safe comparison)."""
    if array is None:
        return b"<none>"
    mx.eval(array)
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return str(array.dtype).encode() + str(array.shape).encode() + np.array(array).tobytes()


def read_bits(state) -> list[bytes]:
    return [bits(state.latent), bits(state.rope), bits(state.index_keys)]


def describe(cache) -> tuple:
    """Everything observable about a cache without changing it."""
    return (
        cache.signature(),
        cache.offset,
        cache.batch_size,
        list(cache.row_offsets),
        list(cache.left_pad),
        cache.minimum_reusable_offset,
        [bits(a) for a in cache.state],
        bits(cache.stored_index_keys()),
    )


CASES_BY_ID = {case.id: case for case in all_cases()}
