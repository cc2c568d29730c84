"""Measures 4, 5, 6 and 11: restores from the page cache (full, prefix, batched, with and without checksums), and
the MLA latent's restore against a memcpy of its bytes and, cold, against mlx-lm's cold load (issue 32's targets).

Every restore is followed by ``mx.eval`` of every array it returns, because MLX (and ``mx.load``, which mlx-lm
uses) is lazy: a restore that has not produced its bytes has not restored anything. Files are read from the page
cache (they were just written and each measure has a warm-up run), as in baseline.md's page-cache rows.
"""

from __future__ import annotations

import mlx.core as mx

from . import data
from .context import Context
from .harness import Row, Timed, failed, guarded, remove, time_interleaved
from .save import mlx_lm_save_fsync


def eval_caches(caches) -> None:
    mx.eval([c.state for c in caches])


def run(ctx: Context, only: set[str]) -> list[Row]:
    w = ctx.workload
    rows: list[Row] = []
    mlx_path = ctx.scratch.fresh("mlxlm-load").with_suffix(".safetensors")
    store_path = ctx.scratch.fresh("store-restore")
    store = ctx.open_store(store_path)
    tokens = ctx.tokens()
    try:
        variants = data.VARIANTS if "4" in only else ("mla-f32",)
        for i, variant in enumerate(variants):  # distinct tokens per variant: prefix lookups pick the MLA session
            store.save(f"s-{variant}", tokens if i == 0 else ctx.tokens(seed=100 + i), ctx.caches(variant))
        if "4" in only:
            mlx_lm_save_fsync(mlx_path, data.mlx_lm_caches(ctx.data()))
            rows += guarded("4", f"restore + eval ({w.name})", _restores, ctx, store, variants, mlx_path)
            rows += guarded("4", f"warm restore vs memcpy, mla-f32 ({w.name})", _vs_memcpy, ctx, store)
            store.close()
            rows += guarded("4", f"cold restore, mla-f32 ({w.name})", _cold, ctx, store_path, mlx_path)
            store = ctx.open_store(store_path)
        if "5" in only:
            rows += guarded("5", f"restore_prefix ({w.name})", _prefix, ctx, store, tokens)
        if "11" in only:
            store.close()
            rows += guarded("11", f"restore with checksums verified ({w.name})", _verify_cost, ctx, store_path)
            store = ctx.open_store(store_path)
        if "6" in only:
            ctx.drop()
            rows += guarded("6", "restore_batch of 8 sessions", _batch, ctx, store)
    finally:
        store.close()
        remove(store_path)
        remove(mlx_path)
    return rows


def _restore_case(store, sid: str) -> Timed:
    return Timed(lambda _: eval_caches(store.restore(sid).caches))


def _restores(ctx: Context, store, variants, mlx_path) -> list[Row]:
    """Every variant's restore and mlx-lm's load of the f32 file, interleaved."""
    w = ctx.workload
    s = time_interleaved({"mlx-lm": Timed(lambda _: _mlx_lm_load(mlx_path)),
                          **{v: _restore_case(store, f"s-{v}") for v in variants}}, ctx.reps)
    rows = []
    for variant in variants:
        same = variant == "mla-f32"
        rows.append(Row("4", f"restore + eval, page cache, checksums on, {variant} ({w.name})", s[variant],
                        s["mlx-lm"], "mlx-lm load_prompt_cache + eval" + ("" if same else " (f32, more bytes)"),
                        "≤ 1.0×" if same else "(report)", 1.0 if same else None, check="ratio" if same else "none"))
    rows.append(_with_cache_limit(ctx, store, mlx_path))
    return rows


def _mlx_lm_load(path) -> None:
    from mlx_lm.models.cache import load_prompt_cache

    data.eval_mlx_lm(load_prompt_cache(str(path)))


def _with_cache_limit(ctx: Context, store, mlx_path) -> Row:
    """Both sides again with MLX's allocator allowed to keep 2 GiB of freed buffers: MLX on CPU returns freed
    memory to the OS by default, so every restore into fresh arrays page-faults (and zero-fills) its destination."""
    old = mx.set_cache_limit(2 << 30)
    try:
        s = time_interleaved({"kvshelf": _restore_case(store, "s-mla-f32"),
                              "mlx-lm": Timed(lambda _: _mlx_lm_load(mlx_path))}, ctx.reps)
    finally:
        mx.set_cache_limit(old)
        mx.clear_cache()
    return Row("4", f"… mla-f32 again with mx.set_cache_limit(2 GiB) on both sides ({ctx.workload.name})",
               s["kvshelf"], s["mlx-lm"], "mlx-lm load_prompt_cache + eval, same limit", "(report)", check="none")


def _vs_memcpy(ctx: Context, store) -> list[Row]:
    """Issue 32: the warm MLA restore against a copy of the same bytes into prefaulted buffers (≤ 2×)."""
    from .kv_targets import memcpy_case  # kv_targets imports this module: imported when used

    s = time_interleaved({"warm": _restore_case(store, "s-mla-f32"),
                          "memcpy": memcpy_case(ctx.caches("mla-f32"))}, ctx.reps)
    return [Row("4", f"warm restore + eval vs memcpy of the same bytes, mla-f32 ({ctx.workload.name})", s["warm"],
                s["memcpy"], "np.copyto into prefaulted buffers", "≤ 2× memcpy", 2.0)]


def _cold(ctx: Context, store_path, mlx_path) -> list[Row]:
    """Issue 32: the MLA restore with the page cache dropped over every store file (and the store opened cold)
    against mlx-lm's ``load_prompt_cache`` of its file, dropped the same way (≤ 1.0×). The handle is opened inside
    the timed call: LMDB allows one per process, so the caller closes its own first."""
    from .kv_targets import drop_page_cache, store_files

    def cold_store(_):
        with ctx.open_store(store_path) as st:
            eval_caches(st.restore("s-mla-f32").caches)

    s = time_interleaved({"kvshelf": Timed(cold_store, lambda: drop_page_cache(store_files(store_path))),
                          "mlx-lm": Timed(lambda _: _mlx_lm_load(mlx_path), lambda: drop_page_cache([mlx_path]))},
                         ctx.reps)
    return [Row("4", f"cold restore + eval (posix_fadvise DONTNEED, store opened cold), mla-f32 ({ctx.workload.name})",
                s["kvshelf"], s["mlx-lm"], "mlx-lm load_prompt_cache + eval, cold", "≤ 1.0×", 1.0)]


def _prefix(ctx: Context, store, tokens) -> list[Row]:
    w = ctx.workload
    n = w.tokens // 4
    name = f"restore_prefix {n} of {w.tokens} tokens + eval ({w.name})"
    prompt = tokens[: n + 1]  # usable prefix p = min(lcp, len(P) - 1) = n
    got = store.restore_prefix(prompt)
    if got is None or got.length != n:
        return [failed("5", name, f"restore_prefix returned {getattr(got, 'length', None)} tokens, expected {n}")]
    s = time_interleaved({"prefix": Timed(lambda _: eval_caches(store.restore_prefix(prompt).caches)),
                          "full": _restore_case(store, "s-mla-f32"),
                          "raw": raw_prefix_case(store, "s-mla-f32", n)}, ctx.reps)
    return [Row("5", name, s["prefix"], s["full"], f"full restore of {w.tokens} + eval", "≤ 0.35×", 0.35),
            Row("5", f"… the same vs a raw read of the prefix chunks' bytes ({w.name})", s["prefix"], s["raw"],
                "preadv of the same chunk bytes from their packs, warm", "≤ 1.5×", 1.5)]


def raw_prefix_case(store, session_id: str, length: int) -> Timed:
    """The floor of a prefix restore (issue 32): ``preadv`` of exactly the bytes of the stored chunks that cover
    ``length`` tokens of the session, from where they lie in their packs, into one preallocated buffer (page cache
    warm, as the restore's). The chunk straddling the cut is read whole, as the restore reads it."""
    import os

    manifest = store.admin.manifest(_snapshot_id(store, session_id))
    spans = []
    for ref in [r for r in manifest.chunks if r.start < length] + list(manifest.own):
        name, offset, nbytes = store.admin.chunk_location(ref.hash)
        spans.append((store.bytes.path(name), offset, nbytes))
    buf = memoryview(bytearray(sum(n for _, _, n in spans)))
    buf[:] = b"\1" * len(buf)  # prefaulted, as the restore's destinations are touched by its reads

    def read(_):
        at = 0
        for path, offset, nbytes in spans:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [buf[at:at + nbytes]], offset)
            finally:
                os.close(fd)
            if got != nbytes:
                raise RuntimeError(f"short read of {path}")
            at += nbytes

    return Timed(read)


def _snapshot_id(store, session_id: str) -> str:
    return next(s.snapshot_id for s in store.sessions() if s.session_id == session_id)


def verify_cases(ctx: Context, store_path, sid: str) -> dict[str, Timed]:
    """The same restore through a verifying handle and a ``verify=False`` one, for ``time_interleaved``. LMDB
    allows one handle per process, so each repetition opens its handle in the (untimed) setup and closes it after;
    the files stay in the page cache, so both sides read warm."""
    def case(**kw) -> Timed:
        return Timed(lambda st: eval_caches(st.restore(sid).caches),
                     lambda: ctx.open_store(store_path, **kw), lambda st: st.close())

    return {"checked": case(), "plain": case(verify=False)}


def _verify_cost(ctx: Context, store_path) -> list[Row]:
    w = ctx.workload
    s = time_interleaved(verify_cases(ctx, store_path, "s-mla-f32"), ctx.reps)
    return [Row("11", f"restore + eval with checksums verified ({w.name})", s["checked"], s["plain"],
                "restore + eval, verification off", "≤ 1.10×", 1.10)]


def _batch(ctx: Context, store) -> list[Row]:
    w = ctx.workload
    step = max(1, w.tokens // 16)
    lengths = [step * (i + 1) for i in range(8)]  # 256 .. 2048 at L
    name = f"restore_batch of 8 sessions ({lengths[0]}..{lengths[-1]} tokens) + eval ({w.name})"
    target = "≤ 0.8×"
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

    s = time_interleaved({"separate": separate, "batched": batched}, ctx.reps)
    return [Row("6", name, s["batched"], s["separate"], "8 restores + merge_rows + eval", target, 0.8)]
