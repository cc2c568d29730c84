"""Child process for measure 10: one save or restore of the large workload, reporting its peak RSS as JSON.

``python -m benchmarks.rss_worker {save|restore|mlx-save|mlx-load|kv-save|mlx-kv-save} PATH SIZE`` prints one JSON line:
``rss_start`` (after imports, before any cache data exists), ``rss_before`` (just before the operation) and
``peak`` (VmHWM over the operation: the kernel's high-water mark is reset through ``/proc/self/clear_refs`` right
before it, so building the test data does not count). Bytes throughout.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def main(argv: list[str]) -> int:
    op, path, size = argv[0], Path(argv[1]), argv[2]
    import mlx.core as mx

    # Import everything any branch uses before the first reading, so lazy imports don't count as the operation.
    import mlx_lm.models.cache  # noqa: F401

    from benchmarks import data
    from kvshelf.store import Identity, open_store

    w = data.SIZES[size][1]
    tokens = data.token_ids(w.tokens, seed=5)
    out: dict[str, object] = {"op": op, "workload": w.name, "nbytes": w.nbytes}
    identity = Identity("bench/glm-dsa-synthetic")
    if op == "restore":
        store = open_store(path, identity=identity)
        gc.collect()
        out["rss_start"] = out["rss_before"] = _status("VmRSS")
        _reset_peak()
        restored = store.restore("big")
        mx.eval([c.state for c in restored.caches])
        out["peak"] = _status("VmHWM")
        out["restored_bytes"] = sum(int(a.nbytes) for c in restored.caches for a in c.state)
        store.close()
    elif op == "mlx-load":
        from mlx_lm.models.cache import load_prompt_cache

        gc.collect()
        out["rss_start"] = out["rss_before"] = _status("VmRSS")
        _reset_peak()
        caches = load_prompt_cache(str(path))
        data.eval_mlx_lm(caches)
        out["peak"] = _status("VmHWM")
    elif op in ("kv-save", "mlx-kv-save"):  # the plain multi-head workload, float16 (512 MiB at L)
        small = size == "small"
        layers, n = (2, 512) if small else (data.KV_LAYERS, 4096)
        kv_tokens = data.token_ids(n, seed=5)
        gc.collect()
        out["rss_start"] = _status("VmRSS")
        pairs = data.kv_data(layers, n, mx.float16)
        out["nbytes"] = sum(int(a.nbytes) for p in pairs for a in p)
        if op == "kv-save":
            held = data.kv_caches(pairs)
        else:
            from benchmarks.kv import mlx_lm_kv

            held = mlx_lm_kv(pairs)
        del pairs
        gc.collect()
        mx.clear_cache()
        out["rss_before"] = _status("VmRSS")
        _reset_peak()
        if op == "kv-save":
            with open_store(path, identity=identity) as store:
                store.save("big", kv_tokens, held)
        else:
            from mlx_lm.models.cache import save_prompt_cache

            save_prompt_cache(str(path), held)
        out["peak"] = _status("VmHWM")
    else:
        gc.collect()
        out["rss_start"] = _status("VmRSS")
        arrays = data.latent_data(w)
        if op == "save":
            held = data.kvshelf_caches(w, arrays, "mla-f32")
        else:
            held = data.mlx_lm_caches(arrays)
        del arrays
        gc.collect()
        mx.clear_cache()
        out["rss_before"] = _status("VmRSS")
        _reset_peak()
        if op == "save":
            with open_store(path, identity=identity) as store:
                store.save("big", tokens, held)
        else:
            from mlx_lm.models.cache import save_prompt_cache

            save_prompt_cache(str(path), held)
        out["peak"] = _status("VmHWM")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
