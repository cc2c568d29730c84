"""Measure 10: peak RSS of a save and of a restore of the large workload, each in its own process.

The figure is the process's peak resident memory over the operation minus its resident memory after imports
(before any cache data existed): for a save that is the cache itself plus whatever the save adds, for a restore
the restored cache plus whatever the restore adds. The target allows the cache's size plus 64 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from . import data
from .context import Context
from .harness import MiB, Row, Sample, remove

REPO = Path(__file__).resolve().parents[1]


def _worker(op: str, path: Path, size: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rss_worker", op, str(path), size], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"worker {op} exited {proc.returncode}: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(doc: dict) -> float:
    return (doc["peak"] - doc["rss_start"]) / MiB


def run(ctx: Context, only: set[str]) -> list[Row]:
    import mlx_lm.models.cache  # noqa: F401 - the workers need it: an absent mlx-lm is "not available" here

    ctx.drop()
    size = next(k for k, v in data.SIZES.items() if v[1] == ctx.large)
    w = ctx.large
    limit = w.nbytes / MiB + 64
    target = f"≤ {w.name} + 64 MiB ({limit:.0f} MiB)"
    rows = []
    mlx_path = ctx.scratch.fresh("rss-mlxlm").with_suffix(".safetensors")
    try:
        mlx_save = _worker("mlx-save", mlx_path, size)
        mlx_load = _worker("mlx-load", mlx_path, size)
        base_save = Sample("MiB", [(mlx_save["peak"] - mlx_save["rss_before"]) / MiB])  # above the cache held
        base_load = Sample("MiB", [_mib(mlx_load)])
    finally:
        remove(mlx_path)
    names = (f"peak RSS of save ({w.name}, {w.nbytes / MiB:.0f} MiB), own process",
             f"peak RSS of restore + eval ({w.name}), own process")
    store_path = ctx.scratch.fresh("rss-store")
    try:
        for name, op, base, base_name in ((names[0], "save", base_save, "mlx-lm save_prompt_cache"),
                                          (names[1], "restore", base_load, "mlx-lm load_prompt_cache + eval")):
            doc = _worker(op, store_path, size)
            if op == "save":  # what the save adds above the caches it saves (building them is not the save)
                rows.append(Row("10", name.replace("peak RSS of save", "peak RSS above the cache of a save"),
                                Sample("MiB", [(doc["peak"] - doc["rss_before"]) / MiB]), base,
                                base_name + ", same measure", "≤ +64 MiB", 64.0, check="value",
                                notes=f"peak {doc['peak'] / MiB:.0f} MiB − {doc['rss_before'] / MiB:.0f} MiB holding "
                                      f"the cache", extra={"worker": doc}))
                continue
            rows.append(Row("10", name, Sample("MiB", [_mib(doc)]), base, base_name, target, limit, check="value",
                            notes=f"peak {doc['peak'] / MiB:.0f} MiB − {doc['rss_start'] / MiB:.0f} MiB after "
                                  f"imports",
                            extra={"worker": doc}))
    finally:
        remove(store_path)
    rows.append(_kv_save(ctx, size))
    return rows


def _kv_save(ctx: Context, size: str) -> Row:
    """Issue 11's row: a KV float16 save (512 MiB at L) may add at most 64 MiB above the cache itself."""
    mlx_path = ctx.scratch.fresh("rss-mlxlm-kv").with_suffix(".safetensors")
    store_path = ctx.scratch.fresh("rss-store-kv")
    try:
        base = _worker("mlx-kv-save", mlx_path, size)
        doc = _worker("kv-save", store_path, size)
    finally:
        remove(mlx_path)
        remove(store_path)
    above = (doc["peak"] - doc["rss_before"]) / MiB
    base_above = (base["peak"] - base["rss_before"]) / MiB
    return Row("10", f"peak RSS above the cache of a save, KV float16 ({doc['nbytes'] / MiB:.0f} MiB), own process",
               Sample("MiB", [above]), Sample("MiB", [base_above]), "mlx-lm save_prompt_cache, same measure",
               "≤ +64 MiB", 64.0, check="value",
               notes=f"peak {doc['peak'] / MiB:.0f} MiB − {doc['rss_before'] / MiB:.0f} MiB holding the cache",
               extra={"worker": doc, "baseline_worker": base})
