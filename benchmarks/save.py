"""Measures 1-3: durable full save, incremental save, and the time ``save_async`` blocks its caller."""

from __future__ import annotations

import os
import time

import mlx.core as mx

from . import data
from .context import Context
from .harness import Row, Sample, fsync_path, remove, time_reps, unavailable

SESSION = "bench"


def raw_write_fsync(path, buffers) -> None:
    """The physical floor: the same bytes, one new file, ``write`` then ``fsync``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for buf in buffers:
            view = buf
            while view:
                n = os.write(fd, view)
                view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def mlx_lm_save_fsync(path, caches) -> None:
    from mlx_lm.models.cache import save_prompt_cache

    save_prompt_cache(str(path), caches)
    fsync_path(path)


def _raw_sample(ctx: Context, buffers) -> Sample:
    return time_reps(lambda p: raw_write_fsync(p, buffers), ctx.reps,
                     setup=lambda: ctx.scratch.fresh("raw"), teardown=remove)


def _mlx_lm_sample(ctx: Context, caches) -> Sample:
    return time_reps(lambda p: mlx_lm_save_fsync(p, caches), ctx.reps,
                     setup=lambda: ctx.scratch.fresh("mlxlm").with_suffix(".safetensors"), teardown=remove)


def _store_save_sample(ctx: Context, tokens, caches, reps: int | None = None) -> tuple[Sample, list]:
    infos = []

    def setup():
        path = ctx.scratch.fresh("store")
        return path, ctx.open_store(path)

    def fn(arg):
        infos.append(arg[1].save(SESSION, tokens, caches))

    def teardown(arg):
        arg[1].close()
        remove(arg[0])

    return time_reps(fn, ctx.reps if reps is None else reps, setup=setup, teardown=teardown), infos


def measure_full_save(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    w = ctx.workload
    target = "≤ 1.10× raw"
    raw_f32 = _raw_sample(ctx, data.raw_buffers(ctx.data()))
    mlx = _mlx_lm_sample(ctx, data.mlx_lm_caches(ctx.data()))
    missing = data.kvshelf_missing(*data.LEGOS, *data.STORE)
    for variant in data.VARIANTS:
        name = f"durable full save, {variant} ({w.name})"
        if missing:
            rows.append(unavailable("1", name, missing, baseline=raw_f32 if variant == "mla-f32" else None,
                                    baseline_name="raw write+fsync, same bytes", target=target))
            continue
        try:
            caches = ctx.caches(variant)
            buffers = data.raw_state_buffers(caches)
            raw = raw_f32 if variant == "mla-f32" else _raw_sample(ctx, buffers)
            value, infos = _store_save_sample(ctx, ctx.tokens(), caches)
        except Exception as exc:  # noqa: BLE001 - a piece that fails to run is reported, not faked
            rows.append(unavailable("1", name, f"{type(exc).__name__}: {exc}", target=target))
            continue
        state = sum(len(b) for b in buffers)
        rows.append(Row("1", name, value, raw, "raw write+fsync, same bytes", target, 1.10,
                        notes=f"{state / 2**20:.1f} MiB",
                        extra={"state_bytes": state, "bytes_written": getattr(infos[-1], "bytes_written", None)}))
        if variant == "mla-f32":
            rows.append(Row("1", name + " vs mlx-lm", value, mlx, "mlx-lm save_prompt_cache+fsync",
                            "(report)", check="none"))
    # mlx-lm against the same floor, so the table shows both baselines side by side.
    rows.append(Row("1", f"mlx-lm save_prompt_cache+fsync, MLA f32 ({w.name}, {w.nbytes / 2**20:.0f} MiB)", mlx,
                    raw_f32, "raw write+fsync, same bytes", "(report)", check="none"))
    return rows


def measure_incremental(ctx: Context) -> list[Row]:
    w = ctx.workload
    extra_n = 256
    name = f"incremental save: +{extra_n} tokens on a stored {w.tokens}-token session ({w.name})"
    target = "≤ 0.10× mlx-lm re-save"
    extra = data.latent_data(w, tokens=extra_n, start=w.tokens, seed_offset=1)
    full = [[mx.concatenate([a, b], axis=1) for a, b in zip(base, ext)] for base, ext in zip(ctx.data(), extra)]
    mx.eval(full)
    mlx_caches = data.mlx_lm_caches(full)
    path = ctx.scratch.fresh("mlxlm-resave").with_suffix(".safetensors")
    mlx_lm_save_fsync(path, data.mlx_lm_caches(ctx.data()))
    baseline = time_reps(lambda _: mlx_lm_save_fsync(path, mlx_caches), ctx.reps)
    remove(path)
    mlx_caches = full = None  # free 190 MiB before the kvshelf side
    missing = data.kvshelf_missing(*data.LEGOS, *data.STORE)
    if missing:
        return [unavailable("2", name, missing, baseline=baseline, baseline_name="mlx-lm full re-save+fsync",
                            target=target)]
    base_tokens = ctx.tokens()
    store_path = ctx.scratch.fresh("store-inc")
    store = ctx.open_store(store_path)
    infos = []
    try:
        base = ctx.caches("mla-f32")
        counter = iter(range(10_000))

        def setup():
            r = next(counter)
            ext = data.latent_data(w, tokens=extra_n, start=w.tokens, seed_offset=100 + r)
            caches = data.kvshelf_caches(w, ctx.data(), "mla-f32", extra=ext)
            sid = f"inc-{r}"
            store.save(sid, base_tokens, base)  # the stored 4096-token session (dedups after the first rep)
            return sid, base_tokens + data.token_ids(extra_n, seed=1000 + r), caches

        def fn(arg):
            infos.append(store.save(*arg))

        def teardown(arg):
            for c in arg[2]:
                c.dispose()

        def setup_live():  # the saved MLACache objects themselves grow: their epoch lets the save reuse hashes
            r = next(counter)
            caches = data.kvshelf_caches(w, ctx.data(), "mla-f32")
            sid = f"live-{r}"
            store.save(sid, base_tokens, caches)
            ext = data.latent_data(w, tokens=extra_n, start=w.tokens, seed_offset=100 + r)
            for c, arrs in zip(caches, ext):
                c.append_latent(*arrs)
            mx.eval([c.state for c in caches])
            return sid, base_tokens + data.token_ids(extra_n, seed=1000 + r), caches

        before = dict(store.counters)
        live = time_reps(fn, ctx.reps, setup=setup_live, teardown=teardown)
        hashed = {k: store.counters[k] - before[k] for k in ("chunks_hashed", "chunks_hash_reused")}
        value = time_reps(fn, ctx.reps, setup=setup, teardown=teardown)
    except Exception as exc:  # noqa: BLE001
        return [unavailable("2", name, f"{type(exc).__name__}: {exc}", baseline=baseline,
                            baseline_name="mlx-lm full re-save+fsync", target=target)]
    finally:
        store.close()
        remove(store_path)
    last = infos[-1]
    return [Row("2", name + ", MLACache grown in place", live, baseline, "mlx-lm full re-save+fsync", target, 0.10,
                extra=hashed),
            Row("2", name + ", fresh MLACache objects (every chunk hashed)", value, baseline,
                "mlx-lm full re-save+fsync", "(report)", check="none",
                extra={"bytes_written": getattr(last, "bytes_written", None),
                       "bytes_reused": getattr(last, "bytes_reused", None)})]


def measure_save_async(ctx: Context) -> list[Row]:
    w = ctx.large
    name = f"save_async: time the caller is blocked ({w.name}, {w.nbytes / 2**20:.0f} MiB)"
    target = "≤ 10 ms"
    missing = data.kvshelf_missing(*data.LEGOS, *data.STORE)
    if missing:
        return [unavailable("3", name, missing, target=target)]
    ctx.drop()
    big = data.latent_data(w)
    caches = data.kvshelf_caches(w, big, "mla-f32")
    del big
    tokens = data.token_ids(w.tokens, seed=3)
    totals = []
    try:
        def setup():
            path = ctx.scratch.fresh("store-async")
            return [path, ctx.open_store(path), 0.0]

        def fn(arg):
            arg[2] = time.perf_counter()
            return arg[1].save_async(SESSION, tokens, caches)

        def teardown(arg):
            arg[1].flush()
            totals.append((time.perf_counter() - arg[2]) * 1e3)
            arg[1].close()
            remove(arg[0])

        value = time_reps(fn, ctx.large_reps, setup=setup, teardown=teardown)
    except Exception as exc:  # noqa: BLE001
        return [unavailable("3", name, f"{type(exc).__name__}: {exc}", target=target)]
    finally:
        for c in caches:
            c.dispose()
        mx.clear_cache()
    total = Sample("ms", totals[-len(value.reps):])
    return [Row("3", name, value, total, "save_async → flush done (durable)", target, 10.0, check="value",
                ratio=value.median / total.median)]


def run(ctx: Context, only: set[str]) -> list[Row]:
    rows = []
    if "1" in only:
        rows += measure_full_save(ctx)
    if "2" in only:
        rows += measure_incremental(ctx)
    if "3" in only:
        rows += measure_save_async(ctx)
    return rows
