"""Measure 9: compaction size ratio and throughput per dtype/format, structured data and i.i.d. noise apart.

Measured through ``kvshelf.tools.compaction.compact`` on a real store: save one session into a fresh store,
``compact(cold_after=0)``, compare the pack files' bytes before and after, then restore and check the arrays are
bit-identical (MB/s: cache bytes over compaction wall time, and over the restore after it). A dataset whose
compaction or check fails is a failed row (and a failed run), never a quietly substituted figure.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from . import data
from .context import Context
from .harness import MiB, Row, Sample, disk_usage, failure_row, remove



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
        except Exception as exc:  # noqa: BLE001 - one dataset failing leaves the others' rows
            rows.append(failure_row("9", f"compaction {title}", exc))
            continue
        ratio = statistics.median(ratios)
        rows.append(_row(title, key, ratio, raw, Sample("MB/s", comp), Sample("MB/s", dec),
                         "kvshelf compact(), pack bytes before/after",
                         {"ratios": ratios, "compact_seconds_note": "wall time of compact(cold_after=0)"}))
    return rows


def run(ctx: Context, only: set[str]) -> list[Row]:
    return _through_compact(ctx)
