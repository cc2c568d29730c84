"""Measure 9: compaction size ratio and throughput per dtype/format, structured data and i.i.d. noise apart.

When ``kvshelf.tools.compaction.compact`` exists it is measured on a real store (blob bytes before/after, wall
time). Until then the row says so and measures what compaction does to each chunk directly: byte-shuffle the
float planes, then zstd, over 256-token pieces of every tensor (labelled "zstd+shuffle on chunk bytes").
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from . import data
from .context import Context
from .harness import MiB, Row, Sample

CHUNK = 256
LEVEL = 3


def _shuffle(buf: np.ndarray, itemsize: int) -> bytes:
    if itemsize == 1:
        return buf.tobytes()
    return buf.reshape(-1, itemsize).T.tobytes()


def _pieces(arrays: list[mx.array]) -> list[tuple[np.ndarray, int]]:
    """256-token pieces of every ``[1, T, w]`` array as (uint8 bytes, float itemsize or 1)."""
    out = []
    for a in arrays:
        itemsize = {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}.get(a.dtype, 1)
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        host = np.array(a, copy=False)
        if host.ndim == 3:
            for s in range(0, host.shape[1], CHUNK):
                out.append((np.ascontiguousarray(host[:, s:s + CHUNK]).reshape(-1).view(np.uint8), itemsize))
        else:
            out.append((np.ascontiguousarray(host).reshape(-1).view(np.uint8), itemsize))
    return out


def zstd_shuffle(pieces, reps: int) -> tuple[float, Sample, Sample, int, int]:
    import zstandard

    raw = sum(p.size for p, _ in pieces)
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    dctx = zstandard.ZstdDecompressor()
    comp_t, dec_t = [], []
    frames: list[bytes] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        frames = [cctx.compress(_shuffle(p, k)) for p, k in pieces]
        comp_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for f, (p, k) in zip(frames, pieces):
            planes = np.frombuffer(dctx.decompress(f), np.uint8)
            if k > 1:
                planes.reshape(k, -1).T.copy()
        dec_t.append(time.perf_counter() - t0)
    packed = sum(len(f) for f in frames)
    mbs = lambda ts: Sample("MB/s", [raw / t / 1e6 for t in ts])  # noqa: E731
    return raw / packed, mbs(comp_t), mbs(dec_t), raw, packed


def _datasets(ctx: Context) -> list[tuple[str, list[mx.array], str]]:
    flat = [a for layer in ctx.data() for a in layer]
    sets = [("float32 latent (structured)", flat, "f32"),
            ("bfloat16 (structured, L data cast)", [a.astype(mx.bfloat16) for a in flat], "bf16"),
            ("float16 (structured, L data cast)", [a.astype(mx.float16) for a in flat], "f16")]
    if not data.kvshelf_missing(*data.LEGOS):
        for variant in ("affine8", "affine4", "turbo-k8"):
            try:
                sets.append((f"{variant} planes", [a for c in ctx.caches(variant) for a in c.state], variant))
            except Exception:  # noqa: BLE001 - a format not built yet is simply not in the list
                pass
    n = ctx.workload.tokens
    noise = [mx.array(data.iid_noise((1, n, w), seed=i)) for i, w in enumerate(ctx.workload.widths * 2)]
    sets += [("float32 i.i.d. noise", noise, "noise-f32"),
             ("bfloat16 i.i.d. noise", [a.astype(mx.bfloat16) for a in noise], "noise-bf16"),
             ("float16 i.i.d. noise", [a.astype(mx.float16) for a in noise], "noise-f16")]
    for _, arrs, _ in sets:
        mx.eval(arrs)
    return sets


def run(ctx: Context, only: set[str]) -> list[Row]:
    reps = max(2, min(ctx.reps, 3))
    note = data.kvshelf_missing("kvshelf.tools.compaction:compact")
    label = "zstd-3+shuffle on chunk bytes" + (f"; compact(): {note}" if note else "")
    rows = []
    for title, arrays, key in _datasets(ctx):
        ratio, comp, dec, raw, packed = zstd_shuffle(_pieces(arrays), reps)
        is_bf16 = key == "bf16"
        rows.append(Row("9", f"compaction {title}", Sample("×", [ratio]), Sample("MiB", [raw / MiB]),
                        "uncompressed", "≥ 1.35×" if is_bf16 else "(report)", 1.35 if is_bf16 else None,
                        check="ratio-min" if is_bf16 else "none", ratio=ratio,
                        notes=f"{label}; compress {comp.median:.0f} MB/s, decompress+unshuffle "
                              f"{dec.median:.0f} MB/s",
                        extra={"compress_MBps": comp.to_json(), "decompress_MBps": dec.to_json(),
                               "raw_bytes": raw, "packed_bytes": packed}))
        label = "zstd-3+shuffle"  # say the long form once
    return rows
