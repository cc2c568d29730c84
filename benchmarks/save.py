"""Measures 1-3: durable full save, incremental save, and the time ``save_async`` blocks its caller."""

from __future__ import annotations

import os
import time

import mlx.core as mx

from . import data
from .context import Context
from .harness import Row, Sample, Timed, fsync_path, guarded, remove, time_interleaved, time_reps

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


def _raw_case(ctx: Context, buffers) -> Timed:
    return Timed(lambda p: raw_write_fsync(p, buffers), lambda: ctx.scratch.fresh("raw"), remove)


def _mlx_lm_case(ctx: Context, caches) -> Timed:
    return Timed(lambda p: mlx_lm_save_fsync(p, caches),
                 lambda: ctx.scratch.fresh("mlxlm").with_suffix(".safetensors"), remove)


def _store_save_case(ctx: Context, tokens, caches, infos: list) -> Timed:
    """A durable save into a fresh store per repetition; each save's result is appended to ``infos``."""
    def setup():
        path = ctx.scratch.fresh("store")
        return path, ctx.open_store(path)

    def fn(arg):
        infos.append(arg[1].save(SESSION, tokens, caches))

    def teardown(arg):
        arg[1].close()
        remove(arg[0])

    return Timed(fn, setup, teardown)


def measure_full_save(ctx: Context) -> list[Row]:
    """Every variant's durable save, its raw write+fsync of the same bytes and mlx-lm's save, interleaved."""
    w = ctx.workload
    target = "≤ 1.10× raw"
    buffers = {v: data.raw_state_buffers(ctx.caches(v)) for v in data.VARIANTS}
    cases = {"raw mla-f32": _raw_case(ctx, data.raw_buffers(ctx.data())),
             "mlx-lm": _mlx_lm_case(ctx, data.mlx_lm_caches(ctx.data()))}
    infos: dict[str, list] = {}
    for variant in data.VARIANTS:
        if variant != "mla-f32":
            cases[f"raw {variant}"] = _raw_case(ctx, buffers[variant])
        cases[variant] = _store_save_case(ctx, ctx.tokens(), ctx.caches(variant), infos.setdefault(variant, []))
    s = time_interleaved(cases, ctx.reps)
    rows: list[Row] = []
    for variant in data.VARIANTS:
        name = f"durable full save, {variant} ({w.name})"
        state = sum(len(b) for b in buffers[variant])
        rows.append(Row("1", name, s[variant], s[f"raw {variant}"], "raw write+fsync, same bytes", target, 1.10,
                        notes=f"{state / 2**20:.1f} MiB",
                        extra={"state_bytes": state,
                               "bytes_written": getattr(infos[variant][-1], "bytes_written", None)}))
        if variant == "mla-f32":
            rows.append(Row("1", name + " vs mlx-lm", s[variant], s["mlx-lm"], "mlx-lm save_prompt_cache+fsync",
                            "(report)", check="none"))
    # mlx-lm against the same floor, so the table shows both baselines side by side.
    rows.append(Row("1", f"mlx-lm save_prompt_cache+fsync, MLA f32 ({w.name}, {w.nbytes / 2**20:.0f} MiB)",
                    s["mlx-lm"], s["raw mla-f32"], "raw write+fsync, same bytes", "(report)", check="none"))
    return rows


def measure_incremental(ctx: Context) -> list[Row]:
    """mlx-lm's full re-save, kvshelf's save of the saved objects grown in place and of fresh objects, interleaved."""
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

        hashed = {k: 0 for k in ("chunks_hashed", "chunks_hash_reused")}

        def live_fn(arg):
            before = {k: store.counters[k] for k in hashed}
            infos.append(store.save(*arg))
            for k in hashed:
                hashed[k] += store.counters[k] - before[k]

        s = time_interleaved({"mlx-lm": Timed(lambda _: mlx_lm_save_fsync(path, mlx_caches)),
                              "live": Timed(live_fn, setup_live, teardown),
                              "fresh": Timed(fn, setup, teardown)}, ctx.reps)
    finally:
        store.close()
        remove(store_path)
        remove(path)
    last = infos[-1]
    return [Row("2", name + ", MLACache grown in place", s["live"], s["mlx-lm"], "mlx-lm full re-save+fsync", target,
                0.10, extra=hashed),
            Row("2", name + ", fresh MLACache objects (every chunk hashed)", s["fresh"], s["mlx-lm"],
                "mlx-lm full re-save+fsync", "(report)", check="none",
                extra={"bytes_written": getattr(last, "bytes_written", None),
                       "bytes_reused": getattr(last, "bytes_reused", None)})]


def measure_save_async(ctx: Context) -> list[Row]:
    """The time ``save_async`` blocks its caller, judged against the durable save it hands off (call → ``flush``
    done, the same repetitions): a ratio, so a slower or busier machine moves both sides alike."""
    w = ctx.large
    name = f"save_async: time the caller is blocked ({w.name}, {w.nbytes / 2**20:.0f} MiB)"
    target = "≤ 0.01× call → durable"
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
    finally:
        for c in caches:
            c.dispose()
        mx.clear_cache()
    total = Sample("ms", totals[-len(value.reps):])
    return [Row("3", name, value, total, "save_async → flush done (durable), same repetitions", target, 0.01)]


def run(ctx: Context, only: set[str]) -> list[Row]:
    rows = []
    for m, what, fn in (("1", "durable full save", measure_full_save),
                        ("2", "incremental save", measure_incremental),
                        ("3", "save_async blocking time", measure_save_async)):
        if m in only:
            rows += guarded(m, what, fn, ctx)
    return rows
