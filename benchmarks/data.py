"""Workloads and their seeded data, plus the two layouts both sides hold: kvshelf latent caches and mlx-lm's.

The data has per-channel structure (a per-channel scale and offset around a low-rank signal that varies smoothly
along the tokens, plus a little noise), because real KV activations look like that and compression figures on
i.i.d. noise say nothing. i.i.d. noise is generated separately (``iid_noise``) for the compaction measure.

mlx-lm's layout for GLM/DeepSeek sparse-attention models is, per layer, a ``CacheList`` of two ``KVCache``s:
latent and RoPE key are the keys and values of the first, the DSA index keys the keys of the second. mlx-lm's
model code also keeps ``zeros_like(keys)`` as the index cache's values; we give it a zero-width values tensor
instead so that both sides hold and move exactly the same bytes (and the very same MLX buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

MiB = 1 << 20


@dataclass(frozen=True)
class Workload:
    """A layer stack of GLM-style latent caches at one length (float32 in memory)."""

    name: str
    layers: int
    kv_lora_rank: int
    rope_head_dim: int
    index_head_dim: int
    tokens: int
    seed: int = 1234

    @property
    def widths(self) -> tuple[int, int, int]:
        return (self.kv_lora_rank, self.rope_head_dim, self.index_head_dim)

    @property
    def bytes_per_token_layer(self) -> int:
        return 4 * sum(self.widths)

    @property
    def nbytes(self) -> int:
        return self.layers * self.tokens * self.bytes_per_token_layer

    def with_tokens(self, tokens: int, name: str | None = None) -> Workload:
        return replace(self, tokens=tokens, name=name or f"{self.name}@{tokens}")

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} layers × {self.tokens} tokens × (latent {self.kv_lora_rank} + rope "
                f"{self.rope_head_dim} + index {self.index_head_dim}) float32 = {self.nbytes / MiB:.0f} MiB")


L = Workload("L", 16, 512, 64, 128, 4096)
L_LARGE = L.with_tokens(16384, "L-large")
SMALL = Workload("small", 2, 128, 64, 64, 512)
SMALL_LARGE = SMALL.with_tokens(2048, "small-large")

# --size -> (main workload, the large one measures 3 and 10 always use)
SIZES: dict[str, tuple[Workload, Workload]] = {
    "small": (SMALL, SMALL_LARGE),
    "L": (L, L_LARGE),
    "L-large": (L_LARGE, L_LARGE),
}


# ---------------------------------------------------------------------------------------------------------------
# Data


def structured(tokens: int, width: int, seed: list[int], *, start: int = 0, seed_offset: int = 0) -> np.ndarray:
    """float32 ``[tokens, width]``: per-channel log-normal scale and offset around a rank-8 signal that varies
    smoothly along the tokens, plus 5% noise. The channel statistics depend on ``seed`` only, so every slice of one
    stream looks alike; ``seed_offset`` shifts the signal's phases and reseeds the noise (another session)."""
    rng = np.random.default_rng(seed)
    rank = 8
    scale = rng.lognormal(mean=0.0, sigma=0.6, size=width).astype(np.float32)
    offset = rng.normal(0.0, 0.5, size=width).astype(np.float32)
    mix = rng.normal(0.0, 1.0, size=(rank, width)).astype(np.float32) / np.sqrt(rank)
    freqs = rng.uniform(0.5, 40.0, size=rank)
    phases = rng.uniform(0, 2 * np.pi, size=rank) + seed_offset * 0.37
    pos = np.arange(start, start + tokens, dtype=np.float64)[:, None]
    signal = np.sin(2 * np.pi * pos * freqs / 4096.0 + phases).astype(np.float32)  # [T, rank], smooth in t
    noise_rng = np.random.default_rng([*seed, start, seed_offset, 7])
    x = signal @ mix
    x += noise_rng.standard_normal((tokens, width), dtype=np.float32) * np.float32(0.05)
    x *= scale
    x += offset
    return x


def layer_arrays(w: Workload, layer: int, *, tokens: int | None = None, start: int = 0,
                 seed_offset: int = 0) -> list[np.ndarray]:
    """Per-family float32 ``[1, T, width]`` arrays of one layer for positions ``start .. start+tokens``."""
    tokens = w.tokens if tokens is None else tokens
    x = structured(tokens, sum(w.widths), [w.seed, layer], start=start, seed_offset=seed_offset)
    out = []
    col = 0
    for width_i in w.widths:
        out.append(np.ascontiguousarray(x[:, col:col + width_i])[None])
        col += width_i
    return out


def latent_data(w: Workload, *, tokens: int | None = None, start: int = 0, seed_offset: int = 0) -> list[list[mx.array]]:
    """``[layer][family]`` evaluated MLX float32 arrays ``[1, T, width]``."""
    layers = []
    for layer in range(w.layers):
        arrs = [mx.array(a) for a in layer_arrays(w, layer, tokens=tokens, start=start, seed_offset=seed_offset)]
        mx.eval(arrs)
        layers.append(arrs)
    return layers


# The plain multi-head workload: 32 layers × 8 KV heads × head dim 128 (float16 / bfloat16).
KV_LAYERS, KV_HEADS, KV_HEAD_DIM = 32, 8, 128


def kv_data(layers: int, tokens: int, dtype, *, noise: bool = False, seed: int = 4321) -> list[tuple[mx.array, mx.array]]:
    """Per layer (keys, values) ``[1, H, T, D]`` of ``dtype``: structured per (head, channel), or i.i.d. noise."""
    out = []
    width = KV_HEADS * KV_HEAD_DIM
    for layer in range(layers):
        pair = []
        for which in (0, 1):
            if noise:
                x = iid_noise((tokens, width), seed=seed + 2 * layer + which)
            else:
                x = structured(tokens, width, [seed, layer, which])
            heads = np.ascontiguousarray(x.reshape(tokens, KV_HEADS, KV_HEAD_DIM).transpose(1, 0, 2))[None]
            a = mx.array(heads).astype(dtype)
            pair.append(a)
        mx.eval(pair)
        out.append(tuple(pair))
    return out


def kv_caches(pairs: list[tuple[mx.array, mx.array]]) -> list[Any]:
    """kvshelf's mlx-lm-compatible ``KVCache`` per layer, filled by one ``update_and_fetch``."""
    from kvshelf.latent_legos.kv import KVCache

    caches = []
    for k, v in pairs:
        c = KVCache()
        c.update_and_fetch(k, v)
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def iid_noise(shape: tuple[int, ...], seed: int = 99) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def token_ids(n: int, seed: int, low: int = 0, high: int = 150_000) -> list[int]:
    return np.random.default_rng(seed).integers(low, high, size=n).tolist()


# ---------------------------------------------------------------------------------------------------------------
# kvshelf side (imported lazily, so importing the benchmarks does not import the library)



# Variant name -> (scheme factory, paged block size)
VARIANTS = ("mla-f32", "affine8", "affine4", "turbo-k8", "paged-f32")


def scheme_for(variant: str):
    """(KvScheme, paged block size) of a variant, through the public scheme factories."""
    from kvshelf.latent_legos import KvScheme

    if variant in ("mla-f32", "paged-f32"):
        return KvScheme.bf16(), (256 if variant == "paged-f32" else None)
    if variant == "affine8":
        return KvScheme.affine(8, 64), None
    if variant == "affine4":
        return KvScheme.affine(4, 64), None
    if variant == "turbo-k8":
        return KvScheme.turbo(8, 3), None
    raise ValueError(variant)


def geometry(w: Workload):
    from kvshelf.latent_legos import LatentGeometry

    return LatentGeometry(kv_lora_rank=w.kv_lora_rank, rope_head_dim=w.rope_head_dim, index_head_dim=w.index_head_dim)


def kvshelf_caches(w: Workload, data: list[list[mx.array]], variant: str = "mla-f32",
                   extra: list[list[mx.array]] | None = None) -> list[Any]:
    """One kvshelf latent cache per layer holding ``data`` (then ``extra`` appended), evaluated."""
    from kvshelf.latent_legos import composed_latent_cache

    scheme, block = scheme_for(variant)
    g = geometry(w)
    caches = []
    for layer, arrs in enumerate(data):
        c = composed_latent_cache(scheme, block, layer, g)
        c.append_latent(*arrs)
        if extra is not None:
            c.append_latent(*extra[layer])
        mx.eval(c.state)
        caches.append(c)
    return caches


def state_bytes(caches: list[Any]) -> int:
    return sum(int(a.nbytes) for c in caches for a in c.state)


# ---------------------------------------------------------------------------------------------------------------
# mlx-lm side


def mlx_lm_caches(data: list[list[mx.array]]) -> list[Any]:
    """mlx-lm's per-layer ``CacheList(KVCache, KVCache)`` over the very same buffers (reshape is a view)."""
    from mlx_lm.models.cache import CacheList, KVCache

    caches = []
    for latent, rope, index in data:
        t = latent.shape[1]
        kv = KVCache()
        kv.keys, kv.values, kv.offset = latent.reshape(1, 1, t, -1), rope.reshape(1, 1, t, -1), t
        ix = KVCache()
        ix.keys, ix.values, ix.offset = index.reshape(1, 1, t, -1), mx.zeros((1, 1, t, 0), mx.float32), t
        caches.append(CacheList(kv, ix))
    mx.eval([[c.keys, c.values] for cl in caches for c in cl.caches])
    return caches


def eval_mlx_lm(caches: list[Any]) -> None:
    mx.eval([[c.keys, c.values] for cl in caches for c in cl.caches])


def raw_buffers(data: list[list[mx.array]]) -> list[memoryview]:
    """Zero-copy byte views of every array (the 'same bytes' the raw baselines write)."""
    out = []
    for arrs in data:
        for a in arrs:
            out.append(memoryview(np.array(a, copy=False)).cast("B"))
    return out


def raw_state_buffers(caches: list[Any]) -> list[memoryview]:
    """Zero-copy byte views of every array in the caches' ``state`` (bf16 through a uint16 view)."""
    out = []
    for c in caches:
        for a in c.state:
            if a.dtype == mx.bfloat16:
                a = a.view(mx.uint16)
                mx.eval(a)
            host = np.array(a, copy=False)
            if not host.flags["C_CONTIGUOUS"]:
                host = np.ascontiguousarray(host)
            out.append(memoryview(host.reshape(-1).view(np.uint8)))
    return out
