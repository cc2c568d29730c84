"""Measure 8: bytes on disk for 10 sessions sharing a long prefix, each with its own tail.

kvshelf stores content-addressed chunks, so the shared prefix should be on disk once; mlx-lm writes one full
file per session. "Bytes on disk" is allocated space (``st_blocks``) of every file under the store directory:
blobs, the LMDB index and anything else the store keeps.
"""

from __future__ import annotations

import mlx.core as mx

from . import data
from .context import Context
from .harness import MiB, Row, Sample, disk_usage, remove
from .save import mlx_lm_save_fsync

SESSIONS = 10


def run(ctx: Context, only: set[str]) -> list[Row]:
    w = ctx.workload
    own = max(1, w.tokens // 8)  # 512 at L
    name = f"bytes on disk: {SESSIONS} sessions × ({w.tokens} shared + {own} own tokens) ({w.name})"
    unique = (w.tokens + SESSIONS * own) * w.bytes_per_token_layer * w.layers
    unique_s = Sample("MiB", [unique / MiB])
    prefix_tokens = ctx.tokens()
    tails = [data.latent_data(w, tokens=own, start=w.tokens, seed_offset=200 + i) for i in range(SESSIONS)]

    # mlx-lm: ten files, each a full copy of prefix + tail.
    mlx_dir = ctx.scratch.fresh("mlxlm-files")
    mlx_dir.mkdir()
    for i, tail in enumerate(tails):
        full = [[mx.concatenate([a, b], axis=1) for a, b in zip(base, ext)] for base, ext in zip(ctx.data(), tail)]
        mlx_lm_save_fsync(mlx_dir / f"s{i}.safetensors", data.mlx_lm_caches(full))
        del full
    mlx_alloc, _ = disk_usage(mlx_dir)
    remove(mlx_dir)
    mlx_s = Sample("MiB", [mlx_alloc / MiB])

    path = ctx.scratch.fresh("store-disk")
    try:
        with ctx.open_store(path) as store:
            for i, tail in enumerate(tails):
                caches = data.kvshelf_caches(w, ctx.data(), "mla-f32", extra=tail)
                store.save(f"d{i}", prefix_tokens + data.token_ids(own, seed=300 + i), caches)
                for c in caches:
                    c.dispose()
        alloc, apparent = disk_usage(path)
    finally:
        remove(path)
    value = Sample("MiB", [alloc / MiB])
    return [Row("8", name, value, unique_s, "unique tokens' bytes", "≤ 1.05× unique", 1.05,
                extra={"allocated_bytes": alloc, "apparent_bytes": apparent, "unique_bytes": unique}),
            Row("8", f"… the same vs mlx-lm's {SESSIONS} files", value, mlx_s, f"mlx-lm: {SESSIONS} files",
                "(report)", check="none", extra={"mlx_lm_allocated_bytes": mlx_alloc})]
