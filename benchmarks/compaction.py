"""Measure 9: compaction size ratio and throughput per dtype/format, structured data and i.i.d. noise apart.

When ``kvshelf.tools.compaction.compact`` exists it is measured on a real store: save one session into a fresh
store, ``compact(cold_after=0)``, compare the blob files' bytes before and after, then restore and check the
arrays are bit-identical (MB/s: cache bytes over compaction wall time, and over the restore after it). Until then
the rows say so and measure what compaction does to each chunk directly: byte-shuffle the float planes, then zstd,
over 256-token pieces of every tensor (labelled "zstd+shuffle on chunk bytes").
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from kvshelf.store.objects.shuffle import shuffle

from . import data
from .context import Context
from .harness import MiB, Row, Sample, disk_usage, remove, unavailable

CHUNK = 256
LEVEL = 3


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
        frames = [cctx.compress(shuffle(p, k)) for p, k in pieces]
        comp_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for f, (p, k) in zip(frames, pieces):
            planes = np.frombuffer(dctx.decompress(f), np.uint8)
            if k > 1:
                planes.reshape(k, -1).T.copy()
        dec_t.append(time.perf_counter() - t0)
    packed = sum(len(f) for f in frames)
    mbs = lambda ts: Sample("MB/s", [raw / t / 1e6 for t in ts])
    return raw / packed, mbs(comp_t), mbs(dec_t), raw, packed


def _datasets(ctx: Context) -> list[tuple[str, list[mx.array], str]]:
    """Arrays for the direct zstd+shuffle measurement (used until ``compact`` exists)."""
    flat = [a for layer in ctx.data() for a in layer]
    sets = [("float32 latent (structured)", flat, "f32"),
            ("bfloat16 (structured, L data cast)", [a.astype(mx.bfloat16) for a in flat], "bf16"),
            ("float16 (structured, L data cast)", [a.astype(mx.float16) for a in flat], "f16")]
    if not data.kvshelf_missing(*data.LEGOS):
        for variant in ("affine8", "affine4", "turbo-k8"):
            try:
                sets.append((f"{variant} planes", [a for c in ctx.caches(variant) for a in c.state], variant))
            except Exception as exc:  # noqa: BLE001 - a format not built yet is simply not in the list
                ctx.facts[f"compaction_skipped_{variant}"] = f"{type(exc).__name__}: {exc}"
    n = ctx.workload.tokens
    noise = [mx.array(data.iid_noise((1, n, w), seed=i)) for i, w in enumerate(ctx.workload.widths * 2)]
    sets += [("float32 i.i.d. noise", noise, "noise-f32"),
             ("bfloat16 i.i.d. noise", [a.astype(mx.bfloat16) for a in noise], "noise-bf16"),
             ("float16 i.i.d. noise", [a.astype(mx.float16) for a in noise], "noise-f16")]
    for _, arrs, _ in sets:
        mx.eval(arrs)
    return sets


def _direct(ctx: Context, note: str) -> list[Row]:
    reps = max(2, min(ctx.reps, 3))
    label = f"zstd-{LEVEL}+shuffle on chunk bytes; compact(): {note}"
    rows = []
    for title, arrays, key in _datasets(ctx):
        ratio, comp, dec, raw, packed = zstd_shuffle(_pieces(arrays), reps)
        rows.append(_row(title, key, ratio, raw, comp, dec, label, {"packed_bytes": packed}))
        label = f"zstd-{LEVEL}+shuffle"  # say the long form once
    return rows


def _row(title, key, ratio, raw, comp: Sample, dec: Sample, label, extra) -> Row:
    is_bf16 = key.startswith("kv-bf16") or key == "bf16"
    return Row("9", f"compaction {title}", Sample("×", [ratio]), Sample("MiB", [raw / MiB]), "uncompressed",
               "≥ 1.35×" if is_bf16 else "(report)", 1.35 if is_bf16 else None,
               check="ratio-min" if is_bf16 else "none", ratio=ratio,
               notes=f"{label}; compact {comp.median:.0f} MB/s, restore after {dec.median:.0f} MB/s",
               extra={"compact_MBps": comp.to_json(), "restore_MBps": dec.to_json(), "raw_bytes": raw, **extra})


# ---------------------------------------------------------------------------------------------------------------
# Through the real tool: save into a fresh store, compact it, restore from it.


def _store_datasets(ctx: Context):
    """(title, key, builder) where builder() -> (tokens, caches); built lazily to bound memory."""
    w = ctx.workload
    kv_layers = max(1, w.layers // 2)  # 8 of the 32 plain layers at L: 128 MiB, plenty for a ratio
    n = w.tokens
    toks = lambda seed: data.token_ids(n, seed=seed)

    def latent(variant):
        return lambda: (toks(1), data.kvshelf_caches(w, ctx.data(), variant))

    def latent_noise():
        arrs = [[mx.array(data.iid_noise((1, n, width), seed=97 + 3 * layer + j)) for j, width in
                 enumerate(w.widths)] for layer in range(w.layers)]
        return toks(2), data.kvshelf_caches(w, arrs, "mla-f32")

    def kv(dtype, noise):
        return lambda: (toks(3), data.kv_caches(data.kv_data(kv_layers, n, dtype, noise=noise)))

    kv_desc = f"{kv_layers} layers × {data.KV_HEADS} heads × {data.KV_HEAD_DIM}"
    return [
        ("MLA float32 latent (structured)", "f32", latent("mla-f32")),
        (f"KV bfloat16 ({kv_desc}, structured)", "kv-bf16", kv(mx.bfloat16, False)),
        (f"KV float16 ({kv_desc}, structured)", "kv-f16", kv(mx.float16, False)),
        ("affine8 latent planes", "affine8", latent("affine8")),
        ("affine4 latent planes", "affine4", latent("affine4")),
        ("turbo-k8 latent planes", "turbo-k8", latent("turbo-k8")),
        ("MLA float32 i.i.d. noise", "noise-f32", latent_noise),
        ("KV bfloat16 i.i.d. noise", "noise-kv-bf16", kv(mx.bfloat16, True)),
        ("KV float16 i.i.d. noise", "noise-kv-f16", kv(mx.float16, True)),
    ]


def _same_live(a: mx.array, b: mx.array) -> bool:
    """Bit-identical on the original's extent (a restored key/value buffer may carry more capacity)."""
    if any(sb < sa for sa, sb in zip(a.shape, b.shape)) or a.ndim != b.ndim:
        return False
    b = b[tuple(slice(0, n) for n in a.shape)]
    if a.dtype == mx.bfloat16:
        a, b = a.view(mx.uint16), b.view(mx.uint16)
    return bool(mx.array_equal(a, b).item())


def _through_compact(ctx: Context) -> list[Row]:
    from kvshelf.tools.compaction import compact

    reps = max(1, ctx.reps // 3)  # sizes are deterministic; each repetition is a fresh store + compaction
    rows = []
    for title, key, build in _store_datasets(ctx):
        try:
            tokens, caches = build()
            raw = sum(int(a.nbytes) for c in caches for a in c.state)
            ratios, comp, dec = [], [], []
            for _ in range(reps):
                path = ctx.scratch.fresh("store-compact")
                try:
                    with ctx.open_store(path) as store:
                        store.save("c", tokens, caches)
                        before = disk_usage(path / "packs", apparent=True) + disk_usage(path / "blobs", apparent=True)
                        report = compact(store, cold_after=0, grace=0, merge=False, densify_pages=False,
                                         compact_index=False)
                        after = disk_usage(path / "packs", apparent=True) + disk_usage(path / "blobs", apparent=True)
                        t0 = time.perf_counter()
                        restored = store.restore("c").caches
                        mx.eval([c.state for c in restored])
                        dec_t = time.perf_counter() - t0
                        same = all(_same_live(a, b) for c0, c1 in zip(caches, restored)
                                   for a, b in zip(c0.state, c1.state))
                        if not same:
                            raise RuntimeError("restore after compaction is not bit-identical")
                finally:
                    remove(path)
                ratios.append(before / after)
                comp.append(raw / report.seconds / 1e6)
                dec.append(raw / dec_t / 1e6)
            for c in caches:
                c.dispose()
            del caches
            mx.clear_cache()
        except Exception as exc:  # noqa: BLE001
            rows.append(unavailable("9", f"compaction {title}", f"{type(exc).__name__}: {exc}"))
            continue
        ratio = statistics.median(ratios)
        rows.append(_row(title, key, ratio, raw, Sample("MB/s", comp), Sample("MB/s", dec),
                         "kvshelf compact(), pack bytes before/after",
                         {"ratios": ratios, "compact_seconds_note": "wall time of compact(cold_after=0)"}))
    return rows


def run(ctx: Context, only: set[str]) -> list[Row]:
    note = data.kvshelf_missing("kvshelf.tools.compaction:compact", *data.STORE)
    if note:
        return _direct(ctx, note)
    return _through_compact(ctx)
