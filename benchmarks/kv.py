"""Measures 1 and 4 on the plain multi-head workload: 32 layers × 8 KV heads × head dim 128 × 4,096 tokens,
float16 and bfloat16 (512 MiB each), through kvshelf's mlx-lm-compatible ``KVCache``.

The mlx-lm baseline holds the very same key/value arrays in ``mlx_lm.models.cache.KVCache`` (no padding: 4,096
is a multiple of its 256-token step) and saves/loads them with ``save_prompt_cache``/``load_prompt_cache``.
The workload is capped at 4,096 tokens at every ``--size`` except ``small`` (2 layers × 512 tokens).
"""

from __future__ import annotations

import mlx.core as mx

from . import data, kv_targets
from .context import Context
from .harness import MiB, Row, Timed, remove, time_interleaved
from .restore import eval_caches
from .save import _mlx_lm_case, _raw_case, _store_save_case, mlx_lm_save_fsync


def mlx_lm_kv(pairs) -> list:
    from mlx_lm.models.cache import KVCache

    out = []
    for k, v in pairs:
        c = KVCache()
        c.keys, c.values, c.offset = k, v, k.shape[2]
        out.append(c)
    return out


def _raw_views(pairs) -> list[memoryview]:
    import numpy as np

    views = []
    for k, v in pairs:
        for a in (k, v):
            if a.dtype == mx.bfloat16:
                a = a.view(mx.uint16)
                mx.eval(a)
            views.append(memoryview(np.array(a, copy=False)).cast("B"))
    return views


def _restore_case(ctx: Context, tokens_ids, caches, paths: list) -> Timed:
    """Restore + eval of ``caches`` saved once into a store of their own (opened on first use, closed by
    ``_close``)."""
    path = ctx.scratch.fresh("store-kv")
    store = ctx.open_store(path)
    store.save("kv", tokens_ids, caches)
    paths.append((path, store))
    return Timed(lambda _: eval_caches(store.restore("kv").caches))


def _close(paths: list) -> None:
    for path, store in paths:
        store.close()
        remove(path)
    paths.clear()


def run(ctx: Context, only: set[str]) -> list[Row]:
    """Per dtype: the saves (kvshelf's KVCache, mlx-lm's own KVCache through the store, mlx-lm's file, raw
    write+fsync) interleaved, then the restores (the same three readers) interleaved, then issue 11's targets."""
    from mlx_lm.models.cache import load_prompt_cache

    small = ctx.workload.name.startswith("small")
    layers, tokens = (2, 512) if small else (data.KV_LAYERS, 4096)
    rows: list[Row] = []
    ctx.drop()
    for dtype, label in ((mx.float16, "float16"), (mx.bfloat16, "bfloat16")):
        pairs = data.kv_data(layers, tokens, dtype)
        nbytes = sum(int(a.nbytes) for p in pairs for a in p)
        what = f"KV {label} ({layers}×{data.KV_HEADS}×{data.KV_HEAD_DIM}, {tokens} tokens, {nbytes / MiB:.0f} MiB)"
        own = f"{what}, mlx-lm's own KVCache"
        base_caches = mlx_lm_kv(pairs)
        tokens_ids = data.token_ids(tokens, seed=7)
        caches = data.kv_caches(pairs)
        mlx_path = ctx.scratch.fresh("mlxlm-kv").with_suffix(".safetensors")
        mlx_lm_save_fsync(mlx_path, base_caches)  # the baselines of measures 4, 5 (kv_targets) read it
        try:
            if "1" in only:
                infos: list = []
                own_infos: list = []
                s = time_interleaved({"raw": _raw_case(ctx, _raw_views(pairs)),
                                      "mlx-lm": _mlx_lm_case(ctx, base_caches),
                                      "own": _store_save_case(ctx, tokens_ids, base_caches, own_infos),
                                      "kvshelf": _store_save_case(ctx, tokens_ids, caches, infos)}, ctx.reps)
                rows.append(Row("1", f"durable full save, {own}", s["own"], s["mlx-lm"],
                                "mlx-lm save_prompt_cache+fsync", "(report)", check="none",
                                extra={"bytes_written": getattr(own_infos[-1], "bytes_written", None)}))
                rows.append(Row("1", f"durable full save, {what}", s["kvshelf"], s["raw"],
                                "raw write+fsync, same bytes", "≤ 1.10× raw", 1.10,
                                extra={"bytes_written": getattr(infos[-1], "bytes_written", None)}))
                rows.append(Row("1", f"durable full save, {what} vs mlx-lm", s["kvshelf"], s["mlx-lm"],
                                "mlx-lm save_prompt_cache+fsync", "(report)", check="none"))
            if "4" in only:
                stores: list = []
                try:
                    s = time_interleaved(
                        {"mlx-lm": Timed(lambda _, p=mlx_path: mx.eval([[c.keys, c.values]
                                                                       for c in load_prompt_cache(str(p))])),
                         "own": _restore_case(ctx, tokens_ids, base_caches, stores),
                         "kvshelf": _restore_case(ctx, tokens_ids, caches, stores)}, ctx.reps)
                finally:
                    _close(stores)
                rows.append(Row("4", f"restore + eval, page cache, checksums on, {own}", s["own"], s["mlx-lm"],
                                "mlx-lm load_prompt_cache + eval", "≤ 1.0×", 1.0))
                rows.append(Row("4", f"restore + eval, page cache, checksums on, {what}", s["kvshelf"], s["mlx-lm"],
                                "mlx-lm load_prompt_cache + eval", "≤ 1.0×", 1.0))
            pairs = base_caches = None  # the caches hold their own copy: free the source arrays
            rows += kv_targets.run(ctx, only, what, tokens_ids, caches, mlx_path, label)
        finally:
            for c in caches:
                c.dispose()
            del caches
            pairs = base_caches = None
            remove(mlx_path)
            mx.clear_cache()
    return rows
