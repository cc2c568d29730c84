"""Measure 37: encryption at rest (``open_store(path, key=...)``) against the same store without a key.

Both sides save the same MLA f32 session into a fresh store per repetition (durable: pack fsynced, LMDB commit) and
restore it warm (page cache) with ``mx.eval`` of what comes back; the two sides are interleaved. The encrypted side
seals every chunk with AES-256-GCM (one ``encrypt`` per chunk over the joined frame), so its extra cost is one copy
plus AES-GCM per byte on save, and one read of the whole chunk plus AES-GCM and one copy on restore (a sealed chunk
cannot be ``preadv``-ed straight into the destination).
"""

from __future__ import annotations

import os

from .context import Context
from .harness import Row, Timed, guarded, remove, time_interleaved
from .restore import eval_caches
from .save import SESSION

KEY = os.urandom(32)


def _save_case(ctx: Context, tokens, caches, **kw) -> Timed:
    def setup():  # steady state: the tenant's data key exists (its first save writes and fsyncs it once)
        path = ctx.scratch.fresh("store-enc")
        store = ctx.open_store(path, **kw)
        if store._ctx.keys is not None:
            store._ctx.keys.for_tenant("")
        return path, store

    def teardown(arg):
        arg[1].close()
        remove(arg[0])

    return Timed(lambda arg: arg[1].save(SESSION, tokens, caches), setup, teardown)


def _encryption(ctx: Context) -> list[Row]:
    w = ctx.workload
    tokens, caches = ctx.tokens(), ctx.caches("mla-f32")
    target = "≤ 1.15× without a key"
    saves = time_interleaved({"plain": _save_case(ctx, tokens, caches),
                              "sealed": _save_case(ctx, tokens, caches, key=KEY)}, ctx.reps)
    rows = [Row("37", f"durable save, encrypted at rest, MLA f32 ({w.name})", saves["sealed"], saves["plain"],
                "the same save without a key", target, 1.15)]
    paths = {side: ctx.scratch.fresh(f"store-enc-{side}") for side in ("plain", "sealed")}
    stores = {"plain": ctx.open_store(paths["plain"]), "sealed": ctx.open_store(paths["sealed"], key=KEY)}
    try:
        for store in stores.values():
            store.save(SESSION, tokens, caches)
        restores = time_interleaved({side: Timed(lambda _, s=s: eval_caches(s.restore(SESSION).caches))
                                     for side, s in stores.items()}, ctx.reps)
    finally:
        for side, store in stores.items():
            store.close()
            remove(paths[side])
    rows.append(Row("37", f"warm restore + eval, encrypted at rest, MLA f32 ({w.name})", restores["sealed"],
                    restores["plain"], "the same restore without a key", target, 1.15))
    return rows


def run(ctx: Context, only: set[str]) -> list[Row]:
    return guarded("37", "encryption at rest", _encryption, ctx) if "37" in only else []
