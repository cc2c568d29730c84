"""Measures 4, 5, 6 and 11: restores from the page cache (full, prefix, batched, with and without checksums).

Every restore is followed by ``mx.eval`` of every array it returns, because MLX (and ``mx.load``, which mlx-lm
uses) is lazy: a restore that has not produced its bytes has not restored anything. Files are read from the page
cache (they were just written and each measure has a warm-up run), as in baseline.md's page-cache rows.
"""

from __future__ import annotations

import inspect

import mlx.core as mx

from . import data
from .context import Context
from .harness import Row, remove, time_reps, unavailable
from .save import mlx_lm_save_fsync


def eval_caches(caches) -> None:
    mx.eval([c.state for c in caches])


def run(ctx: Context, only: set[str]) -> list[Row]:
    w = ctx.workload
    rows: list[Row] = []
    mlx_base = None
    mlx_path = ctx.scratch.fresh("mlxlm-load").with_suffix(".safetensors")
    if "4" in only:
        mlx_lm_save_fsync(mlx_path, data.mlx_lm_caches(ctx.data()))
        mlx_base = time_reps(lambda _: _mlx_lm_load(mlx_path), ctx.reps)
    missing = data.kvshelf_missing(*data.LEGOS, *data.STORE)
    if missing:
        for m, name in (("4", f"restore + eval, page cache, checksums on, mla-f32 ({w.name})"),
                        ("5", f"restore_prefix {w.tokens // 4} of {w.tokens} tokens ({w.name})"),
                        ("6", "restore_batch of 8 unequal sessions"),
                        ("11", "restore with checksum verification")):
            if m in only:
                rows.append(unavailable(m, name, missing, baseline=mlx_base if m == "4" else None,
                                        baseline_name="mlx-lm load_prompt_cache + eval" if m == "4" else ""))
        return rows

    store_path = ctx.scratch.fresh("store-restore")
    store = ctx.open_store(store_path)
    tokens = ctx.tokens()
    try:
        variants = data.VARIANTS if "4" in only else ("mla-f32",)
        for i, variant in enumerate(variants):
            try:  # distinct tokens per variant, so prefix lookups can only pick the MLA session
                store.save(f"s-{variant}", tokens if i == 0 else ctx.tokens(seed=100 + i), ctx.caches(variant))
            except Exception as exc:  # noqa: BLE001
                rows.append(unavailable("4", f"restore + eval, {variant} ({w.name})", f"save failed: {exc}"))
        full = time_reps(lambda _: eval_caches(store.restore("s-mla-f32").caches), ctx.reps)
        if "4" in only:
            for variant in variants:
                name = f"restore + eval, page cache, checksums on, {variant} ({w.name})"
                try:
                    value = full if variant == "mla-f32" else time_reps(
                        lambda _, v=variant: eval_caches(store.restore(f"s-{v}").caches), ctx.reps)
                except Exception as exc:  # noqa: BLE001
                    rows.append(unavailable("4", name, f"{type(exc).__name__}: {exc}"))
                    continue
                same = variant == "mla-f32"
                rows.append(Row("4", name, value, mlx_base,
                                "mlx-lm load_prompt_cache + eval" + ("" if same else " (f32, more bytes)"),
                                "≤ 1.0×" if same else "(report)", 1.0 if same else None,
                                check="ratio" if same else "none"))
            rows.append(_with_cache_limit(ctx, store, mlx_path))
        if "5" in only:
            rows.append(_prefix(ctx, store, tokens, full))
        if "11" in only:
            store.close()
            rows.append(_verify_cost(ctx, store_path))
            store = ctx.open_store(store_path)
        if "6" in only:
            ctx.drop()
            rows.append(_batch(ctx, store))
    finally:
        store.close()
        remove(store_path)
        remove(mlx_path)
    return rows


def _mlx_lm_load(path) -> None:
    from mlx_lm.models.cache import load_prompt_cache

    data.eval_mlx_lm(load_prompt_cache(str(path)))


def _with_cache_limit(ctx: Context, store, mlx_path) -> Row:
    """Both sides again with MLX's allocator allowed to keep 2 GiB of freed buffers: MLX on CPU returns freed
    memory to the OS by default, so every restore into fresh arrays page-faults (and zero-fills) its destination."""
    old = mx.set_cache_limit(2 << 30)
    try:
        value = time_reps(lambda _: eval_caches(store.restore("s-mla-f32").caches), ctx.reps)
        base = time_reps(lambda _: _mlx_lm_load(mlx_path), ctx.reps)
    finally:
        mx.set_cache_limit(old)
        mx.clear_cache()
    return Row("4", f"… mla-f32 again with mx.set_cache_limit(2 GiB) on both sides ({ctx.workload.name})", value,
               base, "mlx-lm load_prompt_cache + eval, same limit", "(report)", check="none")


def _prefix(ctx: Context, store, tokens, full) -> Row:
    w = ctx.workload
    n = w.tokens // 4
    name = f"restore_prefix {n} of {w.tokens} tokens + eval ({w.name})"
    prompt = tokens[: n + 1]  # usable prefix p = min(lcp, len(P) - 1) = n
    try:
        got = store.restore_prefix(prompt)
        if got is None or got.length != n:
            return unavailable("5", name, f"restore_prefix returned {getattr(got, 'length', None)} tokens, "
                                          f"expected {n}")
        value = time_reps(lambda _: eval_caches(store.restore_prefix(prompt).caches), ctx.reps)
    except Exception as exc:  # noqa: BLE001
        return unavailable("5", name, f"{type(exc).__name__}: {exc}")
    return Row("5", name, value, full, f"full restore of {w.tokens} + eval", "≤ 0.35×", 0.35)


def _verify_cost(ctx: Context, store_path) -> Row:
    """Reopen the same store with ``verify=False`` (LMDB allows one handle per process, so the verifying one is
    closed meanwhile), then a fresh verifying handle, and time the same restore through each."""
    w = ctx.workload
    name = f"restore + eval with checksums verified ({w.name})"
    from kvshelf.store import Store

    if "verify" not in inspect.signature(Store.__init__).parameters:
        return unavailable("11", name, "the store offers no way to restore without verification")
    try:
        with ctx.open_store(store_path, verify=False) as plain:
            base = time_reps(lambda _: eval_caches(plain.restore("s-mla-f32").caches), ctx.reps)
        with ctx.open_store(store_path) as checked:
            value = time_reps(lambda _: eval_caches(checked.restore("s-mla-f32").caches), ctx.reps)
    except Exception as exc:  # noqa: BLE001
        return unavailable("11", name, f"{type(exc).__name__}: {exc}")
    return Row("11", name, value, base, "restore + eval, verification off", "≤ 1.10×", 1.10)


def _batch(ctx: Context, store) -> Row:
    w = ctx.workload
    step = max(1, w.tokens // 16)
    lengths = [step * (i + 1) for i in range(8)]  # 256 .. 2048 at L
    name = f"restore_batch of 8 sessions ({lengths[0]}..{lengths[-1]} tokens) + eval ({w.name})"
    target = "≤ 0.8×"
    try:
        ids = []
        for i, n in enumerate(lengths):
            arrs = data.latent_data(w, tokens=n, seed_offset=10 + i)
            caches = data.kvshelf_caches(w, arrs, "mla-f32")
            sid = f"batch-{i}"
            store.save(sid, data.token_ids(n, seed=50 + i), caches)
            for c in caches:
                c.dispose()
            ids.append(sid)
        del arrs, caches
        mx.clear_cache()

        def separate(_):
            restored = [store.restore(s).caches for s in ids]
            merged = []
            for layer in range(w.layers):
                batch = restored[0][layer].make_empty_batch()
                batch.merge_rows([r[layer] for r in restored])
                merged.append(batch)
            eval_caches(merged)

        def batched(_):
            eval_caches(store.restore_batch(ids).caches)

        base = time_reps(separate, ctx.reps)
        value = time_reps(batched, ctx.reps)
    except Exception as exc:  # noqa: BLE001
        return unavailable("6", name, f"{type(exc).__name__}: {exc}", target=target)
    return Row("6", name, value, base, "8 restores + merge_rows + eval", target, 0.8)
