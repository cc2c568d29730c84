"""Measure 36 (on request, issue 32): ``kvshelf serve``'s time to first token after a ``kill -9`` at long context,
vs a cold prefill, and the cold restore's read speed beside a raw read of the same bytes.

A model whose KV is large per token, built offline (``tests/helpers/tiny_model_dir.py``'s ``llama-long-kv``: 8
layers × 8 KV heads × head dim 128, bfloat16 weights, so 32 KiB of cache per token: 256 MiB at 8K, 1 GiB at 32K,
2 GiB at 64K; cheap layers otherwise). Per prompt length (8,192 tokens by default; ``KVSHELF_BENCH_LONG=8192,32768,
65536`` for more; ``--size small`` uses 512), per repetition, with a fresh system prompt of that many words (the
tokenizer is one token per word) and a one-word user turn, ``max_tokens=1``:

* **cold**: the first request with that prompt on a warm server (model loaded): the whole prefill;
* **restart**: the server SIGKILLed once its write-behind of the prompt is durable, every store file dropped from
  the page cache (``posix_fadvise(DONTNEED)``), the server started again on the store (one untimed short request
  first, so process warm-up is not counted), then the same system prompt with another user turn: the prefix comes
  from disk (read from the server's log line; a repetition served from anywhere else fails the row).

Then, in this process on the same store: **cold restore** (``restore_snapshot`` of the stored prompt + eval, page
cache dropped before each repetition) vs **raw read** of the very pack files it reads (page cache dropped the same
way, ``readinto`` a preallocated buffer), interleaved; the row gives both as GB/s of the cache's bytes in the JSON.
The anchors users quote (a llama.cpp restart tool on an M3 Max: restore + first token 71× / 159× / 201× faster than
prefill at 8K / 32K / 64K) are in the row names for comparison; the ratio here is restart ÷ cold (smaller is better).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .context import Context
from .harness import Row, Sample, Timed, failed, failure_row, remove, time_interleaved

_HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"
ANCHORS = {8192: 71, 32768: 159, 65536: 201}
ARCH = "llama-long-kv"


def _harness():
    if str(_HELPERS) not in sys.path:
        sys.path.insert(0, str(_HELPERS))
    import serve_harness
    import tiny_model_dir

    return serve_harness, tiny_model_dir


def lengths(ctx: Context) -> list[int]:
    if ctx.workload.name == "small":
        return [512]
    raw = os.environ.get("KVSHELF_BENCH_LONG", "8192")
    return [int(x) for x in raw.split(",") if x.strip()]


def drop_page_cache(root: Path) -> list[Path]:
    """Every file under ``root`` out of the page cache (fdatasync first, so dirty pages can go too)."""
    files = [p for p in root.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return files


def _ttft(server, messages, timeout: float = 3600) -> tuple[float, dict]:
    import json

    t0 = time.perf_counter()
    status, raw = server._request("POST", "/v1/chat/completions",
                                  {"messages": messages, "max_tokens": 1, "temperature": 0.0}, timeout=timeout)
    elapsed = (time.perf_counter() - t0) * 1e3
    if status != 200:
        raise RuntimeError(f"chat returned {status}: {raw[:200]!r}")
    return elapsed, json.loads(raw)["usage"]


def _source(server) -> str:
    line = server.prefix_lines()[-1]
    return line["source"] if line["cached"] * 2 >= line["prompt"] else "none"


def _restore_rows(ctx: Context, store_path: Path, model: Path) -> tuple[Sample, Sample, int]:
    """Cold ``restore_snapshot`` + eval of the longest stored session vs a raw read of its pack files."""
    import mlx.core as mx

    from kvshelf.mlx_lm import model_identity
    from kvshelf.store import open_store

    with open_store(store_path, identity=model_identity(str(model))) as store:
        info = max(store.sessions(namespace=None), key=lambda s: s.length)
        manifest = store.admin.manifest(info.snapshot_id)
        packs = sorted({store.admin.chunk_location(r.hash)[0] for r in manifest.all_chunks})
        files = [Path(store.bytes.path(p)) for p in packs]
        nbytes = sum(r.nbytes for r in manifest.all_chunks)
        sizes = [f.stat().st_size for f in files]
        buf = bytearray(max(sizes))

        def cold(_):
            drop_page_cache(store_path)

        def restore(_):
            got = store.restore_snapshot(info.snapshot_id)
            mx.eval([a for c in got.caches for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state])
                     if isinstance(a, mx.array)])

        def raw(_):
            view = memoryview(buf)
            for f, size in zip(files, sizes):
                with open(f, "rb", buffering=0) as fh:
                    done = 0
                    while done < size:
                        got = fh.readinto(view[done:size])
                        if not got:
                            break
                        done += got

        s = time_interleaved({"restore": Timed(restore, lambda: cold(None)), "raw": Timed(raw, lambda: cold(None))},
                             max(1, ctx.reps), warmup=0)
    return s["restore"], s["raw"], nbytes


def run(ctx: Context, only: set[str]) -> list[Row]:
    name = "serve: TTFT after kill -9 at long context vs cold prefill"
    try:
        import mlx_lm  # noqa: F401

        from kvshelf.mlx_lm.serve.server import main as _main  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - no mlx-lm: the row says so
        return [failure_row("36", name, exc, target="(report)")]
    h, tiny = _harness()
    rows: list[Row] = []
    root = ctx.scratch.fresh("long-context")
    root.mkdir()
    arch = "llama" if ctx.workload.name == "small" else ARCH
    model = tiny.make_model_dir(root / "model", arch, seed=13)
    for n in lengths(ctx):
        label = f"{n // 1024}K" if n >= 1024 else str(n)
        anchor = ANCHORS.get(n)
        row_name = f"{name}, {label} tokens ({arch})" + (f" [anchor: 1/{anchor} = {1 / anchor:.4f}×]" if anchor else "")
        store = root / f"store-{n}"
        server = None
        try:
            server = h.Server(model, store, root / f"server-{n}-0.log")
            server.chat([{"role": "user", "content": "warm"}], max_tokens=1)
            times: dict[str, list[float]] = {"cold": [], "restart": []}
            sources: list[str] = []
            prompt_tokens: list[int] = []
            for rep in range(max(1, min(ctx.reps, 2))):  # long prefills: one or two repetitions, no warm-up
                system = tiny.words(n - 16, salt=300 + rep)
                cold_ms, usage = _ttft(server, [{"role": "system", "content": system},
                                                {"role": "user", "content": "hello"}])
                prompt_tokens.append(usage["prompt_tokens"])
                queued = server.log().count("kvshelf write-behind queued tokens=")
                server.wait_log(h.SAVED_LINE, count=queued, timeout=3600)
                server.kill()
                drop_page_cache(store)
                server = h.Server(model, store, root / f"server-{n}-{rep + 1}.log")
                server.chat([{"role": "user", "content": "warm"}], max_tokens=1)
                restart_ms, _ = _ttft(server, [{"role": "system", "content": system},
                                               {"role": "user", "content": "world"}])
                sources.append(_source(server))
                times["cold"].append(cold_ms)
                times["restart"].append(restart_ms)
            server.kill()
            server = None
            if any(s != "disk" for s in sources):
                rows.append(failed("36", row_name, f"restart requests not served from disk: {sources}"))
                continue
            restore_s, raw_s, nbytes = _restore_rows(ctx, store, model)
            gbs = {"restore_GBps": round(nbytes / (restore_s.median / 1e3) / 1e9, 3),
                   "raw_read_GBps": round(nbytes / (raw_s.median / 1e3) / 1e9, 3), "cache_bytes": nbytes}
            ctx.facts[f"long_context_{n}"] = {"prompt_tokens": prompt_tokens, "sources": sources, **gbs}
            cold, restart = Sample("ms", times["cold"]), Sample("ms", times["restart"])
            speedup = cold.median / restart.median if restart.median else None
            rows.append(Row("36", f"{row_name}, {max(prompt_tokens)}-token prompt", restart, cold, "cold prefill",
                            "(report)", check="none", extra={"speedup": speedup, **gbs}))
            rows.append(Row("36", f"… cold restore + eval ({gbs['restore_GBps']} GB/s) vs raw read of its pack files "
                                  f"({gbs['raw_read_GBps']} GB/s), {nbytes / 2**20:.0f} MiB", restore_s, raw_s,
                            "raw read of the same files, page cache dropped", "(report)", check="none", extra=gbs))
        except Exception as exc:  # noqa: BLE001 - a failed row (the run exits non-zero)
            rows.append(failure_row("36", row_name, exc, target="(report)"))
        finally:
            if server is not None:
                server.kill()
            remove(store)
    return rows


__all__ = ["run"]
