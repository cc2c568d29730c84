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
from .harness import MiB, Row, remove, time_reps, unavailable
from .restore import eval_caches
from .save import _mlx_lm_sample, _raw_sample, _store_save_sample


def mlx_lm_kv(pairs) -> list:
    from mlx_lm.models.cache import KVCache

    out = []
    for k, v in pairs:
        c = KVCache()
        c.keys, c.values, c.offset = k, v, k.shape[2]
        out.append(c)
    return out


def _mlx_lm_own(ctx: Context, only: set[str], what: str, tokens_ids, caches, mlx, load) -> list[Row]:
    """mlx-lm's own ``KVCache`` objects saved and restored by the store as they are (kvshelf.mlx_lm's codecs)."""
    missing = data.kvshelf_missing("kvshelf.mlx_lm.codecs.kv:PlainCodec", *data.STORE)
    label = f"{what}, mlx-lm's own KVCache"
    if missing:
        return [unavailable(m, label, missing) for m in sorted({"1", "4"} & only)]
    rows: list[Row] = []
    try:
        if "1" in only:
            value, infos = _store_save_sample(ctx, tokens_ids, caches)
            rows.append(Row("1", f"durable full save, {label}", value, mlx, "mlx-lm save_prompt_cache+fsync",
                            "(report)", check="none", extra={"bytes_written": getattr(infos[-1], "bytes_written", None)}))
        if "4" in only:
            path = ctx.scratch.fresh("store-mlx-lm-kv")
            with ctx.open_store(path) as store:
                store.save("kv", tokens_ids, caches)
                value = time_reps(lambda _: eval_caches(store.restore("kv").caches), ctx.reps)
            remove(path)
            rows.append(Row("4", f"restore + eval, page cache, checksums on, {label}", value, load,
                            "mlx-lm load_prompt_cache + eval", "≤ 1.0×", 1.0))
    except Exception as exc:  # noqa: BLE001 - a failing piece is reported in its row, the run goes on
        rows += [unavailable(m, label, f"{type(exc).__name__}: {exc}") for m in sorted({"1", "4"} & only)]
    return rows


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


def run(ctx: Context, only: set[str]) -> list[Row]:
    small = ctx.workload.name.startswith("small")
    layers, tokens = (2, 512) if small else (data.KV_LAYERS, 4096)
    rows: list[Row] = []
    missing = data.kvshelf_missing("kvshelf.latent_legos.kv:KVCache", *data.STORE)
    ctx.drop()
    for dtype, label in ((mx.float16, "float16"), (mx.bfloat16, "bfloat16")):
        pairs = data.kv_data(layers, tokens, dtype)
        nbytes = sum(int(a.nbytes) for p in pairs for a in p)
        what = f"KV {label} ({layers}×{data.KV_HEADS}×{data.KV_HEAD_DIM}, {tokens} tokens, {nbytes / MiB:.0f} MiB)"
        base_caches = mlx_lm_kv(pairs)
        if "1" in only:
            raw = _raw_sample(ctx, _raw_views(pairs))
            mlx = _mlx_lm_sample(ctx, base_caches)
        from .save import mlx_lm_save_fsync

        mlx_path = ctx.scratch.fresh("mlxlm-kv").with_suffix(".safetensors")
        mlx_lm_save_fsync(mlx_path, base_caches)  # the baselines of measures 4, 5 (kv_targets) read it
        if "4" in only:
            from mlx_lm.models.cache import load_prompt_cache

            load = time_reps(lambda _, p=mlx_path: mx.eval([[c.keys, c.values] for c in load_prompt_cache(str(p))]),
                             ctx.reps)
        if missing:
            if "1" in only:
                rows.append(unavailable("1", f"durable full save, {what}", missing, baseline=raw,
                                        baseline_name="raw write+fsync, same bytes", target="≤ 1.10× raw"))
            if "4" in only:
                rows.append(unavailable("4", f"restore + eval, checksums on, {what}", missing, baseline=load,
                                        baseline_name="mlx-lm load_prompt_cache + eval", target="≤ 1.0×"))
            continue
        tokens_ids = data.token_ids(tokens, seed=7)
        rows += _mlx_lm_own(ctx, only, what, tokens_ids, base_caches, mlx if "1" in only else None,
                            load if "4" in only else None)
        try:
            caches = data.kv_caches(pairs)
            pairs = base_caches = None  # the caches hold their own copy: free the source arrays
            if "1" in only:
                value, infos = _store_save_sample(ctx, tokens_ids, caches)
                rows.append(Row("1", f"durable full save, {what}", value, raw, "raw write+fsync, same bytes",
                                "≤ 1.10× raw", 1.10,
                                extra={"bytes_written": getattr(infos[-1], "bytes_written", None)}))
                rows.append(Row("1", f"durable full save, {what} vs mlx-lm", value, mlx,
                                "mlx-lm save_prompt_cache+fsync", "(report)", check="none"))
            if "4" in only:
                path = ctx.scratch.fresh("store-kv")
                with ctx.open_store(path) as store:
                    store.save("kv", tokens_ids, caches)
                    value = time_reps(lambda _: eval_caches(store.restore("kv").caches), ctx.reps)
                remove(path)
                rows.append(Row("4", f"restore + eval, page cache, checksums on, {what}", value, load,
                                "mlx-lm load_prompt_cache + eval", "≤ 1.0×", 1.0))
            rows += kv_targets.run(ctx, only, what, tokens_ids, caches, mlx_path, label)
            for c in caches:
                c.dispose()
            del caches
        except Exception as exc:  # noqa: BLE001
            for m in sorted({"1", "4"} & only):
                rows.append(unavailable(m, what, f"{type(exc).__name__}: {exc}"))
        pairs = base_caches = None
        remove(mlx_path)
        mx.clear_cache()
    return rows
