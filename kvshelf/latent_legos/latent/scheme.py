"""The KV storage scheme of a composition, and the latent cache it names for each layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import InvalidCacheState
from .encoded import EncodedLatentCache
from ..formats import AffineFormat, LatentFormat, TurboFormat, format_key
from .geometry import LatentGeometry
from .mla import MLACache
from .paged import PagedLatentCache
from ..rows import non_negative


@dataclass(frozen=True, slots=True)
class KvScheme:
    """How K/V (here: latent) state is stored: ``bf16`` (float32 latents), uniform ``affine``, per-layer
    ``affine-layers`` or ``turbo``. ``quantized_kv_start`` is where f32-first storage converts."""

    kind: str
    uniform: AffineFormat | TurboFormat | None = None  # the format of every layer (affine, turbo)
    layers: tuple[tuple[int, AffineFormat], ...] = ()  # (cache index, format) of affine-layers
    quantized_kv_start: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("bf16", "affine", "affine-layers", "turbo"):
            raise InvalidCacheState(f"unknown KV scheme kind {self.kind!r} (bf16, affine, affine-layers, turbo)")

    @classmethod
    def bf16(cls) -> KvScheme:
        return cls("bf16")

    @classmethod
    def affine(cls, bits: int, group_size: int = 64, quantized_kv_start: int = 0) -> KvScheme:
        return cls("affine", uniform=AffineFormat(bits, group_size),
                   quantized_kv_start=non_negative(quantized_kv_start, "quantized_kv_start"))

    @classmethod
    def affine_layers(cls, layers: Mapping[int, tuple[int, int]], quantized_kv_start: int = 0) -> KvScheme:
        """Affine storage for the listed cache indices only (``{layer: (bits, group_size)}``); others stay f32."""
        entries = []
        for layer, spec in sorted(dict(layers).items()):
            non_negative(layer, "layer index")
            bits, group_size = spec
            entries.append((layer, AffineFormat(bits, group_size)))
        if not entries:
            raise InvalidCacheState("affine_layers needs at least one layer")
        return cls("affine-layers", layers=tuple(entries),
                   quantized_kv_start=non_negative(quantized_kv_start, "quantized_kv_start"))

    @classmethod
    def turbo(cls, k_bits: int = 8, v_bits: int = 3, quantized_kv_start: int = 0) -> KvScheme:
        return cls("turbo", uniform=TurboFormat(k_bits, v_bits),
                   quantized_kv_start=non_negative(quantized_kv_start, "quantized_kv_start"))

    @property
    def cache_key(self) -> str:
        """A short stable name of the scheme (part of a store's config fingerprint)."""
        if self.kind == "bf16":
            return "bf16"
        start = f"@{self.quantized_kv_start}" if self.quantized_kv_start else ""
        if self.kind in ("affine", "turbo"):
            return f"{format_key(self.uniform)}{start}"
        listed = ",".join(f"{layer}={f.bits}:{f.group_size}" for layer, f in self.layers)
        return f"affine-layers:{listed}{start}"


def latent_format_of(scheme: KvScheme, layer: int) -> LatentFormat | None:
    """The latent format ``scheme`` names for cache index ``layer`` (``None``: float32)."""
    if not isinstance(scheme, KvScheme):
        raise InvalidCacheState(f"expected a KvScheme (got {type(scheme).__name__})")
    if scheme.kind in ("affine", "turbo"):
        return scheme.uniform
    if scheme.kind == "affine-layers":
        return dict(scheme.layers).get(layer)
    return None


def composed_latent_cache(
    scheme: KvScheme, paged_block_size: int | None, layer: int, geometry: LatentGeometry
) -> MLACache | EncodedLatentCache | PagedLatentCache:
    """The latent cache a composition names for one layer: pages of the format when paged, else ``MLACache``
    for float32 and an f32-first ``EncodedLatentCache`` (converting at ``quantized_kv_start``) otherwise."""
    fmt = latent_format_of(scheme, layer)
    if paged_block_size is not None:
        return PagedLatentCache(geometry, fmt, paged_block_size)
    if fmt is None:
        return MLACache(geometry)
    return EncodedLatentCache(geometry, fmt, scheme.quantized_kv_start)
