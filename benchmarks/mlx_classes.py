"""Measure 35 (on request, issue 32): incremental saves of mlx-lm's own cache classes, and bytes written per cached
token.

* **35a** — for each mlx-lm class (``KVCache`` float16, ``QuantizedKVCache`` 8-bit group 64, ``RotatingKVCache``
  unwrapped): +256 tokens on a stored 4,096-token session, the saved objects grown in place (mlx-lm's own
  ``update_and_fetch``) and saved again, vs mlx-lm's ``save_prompt_cache`` (+ fsync) of the grown caches. mlx-lm's
  objects carry no edit epoch, so the save *verifies* the stored windows (hashes them again on the hash pool) and
  writes only the new window; the JSON extra holds the counted work of each repetition (bytes written, verified).
  ``RotatingKVCache`` (max_size 16,384) has not wrapped, so it is stored as rows like ``KVCache`` (a wrapped ring
  is stored whole; it is not measured here).
* **35b** — bytes written per cached token: one ``KVCache`` session grown turn by turn and saved after every turn
  (the re-saves a chat makes; each save cuts where the last one did, ``chunking.cuts``), for turns of 256
  (chunk-aligned), 100 and 1,000 tokens: bytes the store wrote
  (``store.counters["bytes_written"]``; on Linux also ``/proc/self/io`` ``write_bytes``, the pack frames, the
  manifests and the index pages that reached the disk) ÷ the KV bytes of the final session. Target ≤ 1.25×.

Layout: 32 layers × 8 KV heads × head dim 128 (float16) at L, 2 × 2 × 64 at ``--size small``.
"""

from __future__ import annotations

import gc
import os

import mlx.core as mx

from .context import Context
from .harness import Row, Sample, Timed, failure_row, remove, time_interleaved

EXTRA = 256


def _dims(ctx: Context) -> tuple[int, int, int, int]:
    """(layers, heads, head_dim, tokens)."""
    return (2, 2, 64, 512) if ctx.workload.name == "small" else (32, 8, 128, 4096)


def _kv(shape, seed: int) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return (mx.random.normal(shape, key=k1).astype(mx.float16), mx.random.normal(shape, key=k2).astype(mx.float16))


def _classes():
    from mlx_lm.models import cache as lm

    return {
        "KVCache f16": lm.KVCache,
        "QuantizedKVCache 8-bit g64": lambda: lm.QuantizedKVCache(group_size=64, bits=8),
        "RotatingKVCache unwrapped": lambda: lm.RotatingKVCache(max_size=16384),
    }


def _session(make, dims, n: int, seed: int) -> list:
    layers, heads, hd, _ = dims
    caches = []
    for i in range(layers):
        c = make()
        c.update_and_fetch(*_kv((1, heads, n, hd), seed + i))
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def _grow(caches, dims, n: int, seed: int) -> None:
    _, heads, hd, _ = dims
    for i, c in enumerate(caches):
        c.update_and_fetch(*_kv((1, heads, n, hd), seed + i))
    mx.eval([c.state for c in caches])


def _incremental(ctx: Context, dims) -> list[Row]:
    from .save import mlx_lm_save_fsync

    rows = []
    n = dims[3]
    ids = list(range(n))
    grown_ids = ids + list(range(7, 7 + EXTRA))
    for label, make in _classes().items():
        name = f"incremental save +{EXTRA} on {n} tokens, mlx-lm {label} grown in place ({dims[0]}×{dims[1]}×{dims[2]})"
        target = "≤ 0.10× mlx-lm re-save"
        spath = ctx.scratch.fresh("store-mlx-classes")
        mpath = ctx.scratch.fresh("mlx-classes-resave").with_suffix(".safetensors")
        counter = iter(range(10_000))
        work: list[dict] = []
        try:
            base = _session(make, dims, n, 100)
            _grow(base, dims, EXTRA, 200)
            with ctx.open_store(spath) as store:

                def setup():
                    sid = f"live-{next(counter)}"
                    live = _session(make, dims, n, 100)
                    store.save(sid, ids, live)
                    _grow(live, dims, EXTRA, 300 + len(work))
                    return sid, live

                def fn(arg):
                    before = dict(store.counters)
                    store.save(arg[0], grown_ids, arg[1])
                    work.append({k: store.counters[k] - before[k]
                                 for k in ("bytes_written", "bytes_verified", "bytes_hashed", "bytes_hash_reused")})

                def teardown(arg):
                    arg[1].clear()
                    gc.collect()

                s = time_interleaved({"mlx-lm": Timed(lambda _: mlx_lm_save_fsync(mpath, base),
                                                      teardown=lambda _: remove(mpath)),
                                      "kvshelf": Timed(fn, setup, teardown)}, ctx.reps)
            rows.append(Row("35", name, s["kvshelf"], s["mlx-lm"], "mlx-lm save_prompt_cache+fsync of the grown cache",
                            target, 0.10, check="ratio", extra={"work": work[-ctx.reps:]}))
        except Exception as exc:  # noqa: BLE001 - one class failing must not hide the others
            rows.append(failure_row("35", name, exc, target=target))
        finally:
            remove(spath)
            remove(mpath)
            base = None
            gc.collect()
            mx.clear_cache()
    return rows


def _io_write_bytes() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _bytes_per_token(ctx: Context, dims) -> list[Row]:
    from mlx_lm.models.cache import KVCache

    layers, heads, hd, n = dims
    per_token = layers * 2 * heads * hd * 2
    rows = []
    for turn in (256, 100, 1000):
        turns = max(2, n // turn)
        name = f"bytes written per cached token: KVCache re-saved after each of {turns} turns of {turn} tokens"
        path = ctx.scratch.fresh("store-bytes-per-token")
        try:
            with ctx.open_store(path) as store:
                caches = [KVCache() for _ in range(layers)]
                w0, io0 = store.counters["bytes_written"], _io_write_bytes()
                ids: list[int] = []
                for t in range(turns):
                    _grow(caches, dims, turn, 1000 + 10 * t)
                    ids += [(t * 31 + i) % 50_000 for i in range(turn)]
                    store.save("chat", ids, caches)
                written = store.counters["bytes_written"] - w0
                io1 = _io_write_bytes()
            kv_bytes = per_token * len(ids)
            extra = {"tokens": len(ids), "kv_bytes": kv_bytes, "bytes_written": written}
            if io0 is not None and io1 is not None:
                extra["io_write_bytes"] = io1 - io0
                extra["io_write_ratio"] = round((io1 - io0) / kv_bytes, 3)
            rows.append(Row("35", name, Sample("B", [float(written)]), Sample("B", [float(kv_bytes)]),
                            "KV bytes of the final session", "≤ 1.25×", 1.25, extra=extra))
        except Exception as exc:  # noqa: BLE001
            rows.append(failure_row("35", name, exc, target="≤ 1.25×"))
        finally:
            remove(path)
    return rows


def run(ctx: Context, only: set[str]) -> list[Row]:
    try:
        import mlx_lm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - an absent optional dependency: the row says so
        return [failure_row("35", "incremental saves of mlx-lm's classes", exc, target="≤ 0.10×")]
    dims = _dims(ctx)
    return _incremental(ctx, dims) + _bytes_per_token(ctx, dims)


__all__ = ["run"]
