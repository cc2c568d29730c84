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

Lengths above ``KVSHELF_BENCH_LONG_PREFILL`` (16,384 by default) are **synthesized**: a cold prefill of the
model at 32K takes about an hour on a 2-core CPU and at 64K several hours. The long session is stored without a
prefill instead — the store API under the serve's identity and namespace, the session id and token ids the server
computes for that prompt (``warm.template``), ``KVCache`` planes of the model's shape and dtype filled with seeded
random values — then a server is started on it, warmed, ``kill -9``-ed, the page cache dropped, started again and
timed exactly as above: the restart's restore and first token read and compute the same bytes whatever their
values. Such a row says "KV synthesized" and has no measured cold prefill (``cold prefill NOT measured``); beside
it, only when the same run measured a real prefill at a shorter length ``m``, ``cold_prefill_linear_lower_bound_ms``
(that prefill × n / m, labelled an extrapolation: a prefill grows at least linearly, so restart ÷ it is an upper
bound on the ratio).

Memory (the issue's "no full extra copy"): the restarted server's ``VmHWM`` once the timed request answered, minus
its ``VmRSS`` just before it, against the KV bytes of the restored prompt (``server_peak_growth_over_kv`` in the
JSON; mlx-lm's ``BatchGenerator`` then copies the cache into its batch — ``BatchKVCache.merge`` — which is its own).

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


def prefill_max() -> int:
    return int(os.environ.get("KVSHELF_BENCH_LONG_PREFILL", "16384"))


def _status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def synthesize(store_path: Path, model: Path, messages: list[dict], seed: int) -> int:
    """Store ``messages``' prompt as the server would after prefilling it, without the prefill: under the serve's
    identity (``model_identity`` of the model directory, no options) and default namespace, the session id and token
    ids it computes, ``KVCache`` planes of the model's geometry and dtype holding seeded random values. Returns
    the prompt's token count."""
    import json

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from mlx_lm.utils import load_tokenizer

    from kvshelf.mlx_lm import model_identity
    from kvshelf.mlx_lm.serve.prompt_cache import session_id_for
    from kvshelf.mlx_lm.serve.warm import template
    from kvshelf.store import open_store

    config = json.loads((model / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    weights = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
    dtype = next(v.dtype for k, v in weights.items() if k.endswith("k_proj.weight"))  # mlx-lm caches in it
    tokens = template(load_tokenizer(model), {"messages": messages})
    caches = []
    for i in range(layers):
        k1, k2 = mx.random.split(mx.random.key(seed * 1000 + i))
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, heads, len(tokens), dim), key=k1).astype(dtype),
                           mx.random.normal((1, heads, len(tokens), dim), key=k2).astype(dtype))
        mx.eval(c.keys, c.values)
        caches.append(c)
    with open_store(store_path, identity=model_identity(str(model))) as store:
        store.save(session_id_for(tokens), tokens, caches, namespace="")
    return len(tokens)


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


def _restart(h, tiny, server_box: list, model: Path, store: Path, log: Path, messages: list[dict]):
    """Drop the page cache, start a server on ``store``, warm it with a short request, then time ``messages``:
    (TTFT ms, source of its prefix, server VmHWM growth during the request in bytes, cached tokens)."""
    drop_page_cache(store)
    server = h.Server(model, store, log)
    server_box[0] = server
    server.chat([{"role": "user", "content": "warm"}], max_tokens=1)
    before = _status(server.proc.pid)["VmRSS"]
    restart_ms, _ = _ttft(server, messages)
    grown = _status(server.proc.pid)["VmHWM"] - before
    line = server.prefix_lines()[-1]
    return restart_ms, _source(server), grown, line["cached"]


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
    per_token = _kv_per_token(model)
    measured_prefill: tuple[int, float] | None = None  # (prompt tokens, median ms) of the longest real prefill
    for n in sorted(lengths(ctx)):
        label = f"{n // 1024}K" if n >= 1024 else str(n)
        anchor = ANCHORS.get(n)
        synthesized = n > prefill_max()
        row_name = f"{name}, {label} tokens ({arch}{', KV synthesized' if synthesized else ''})" + (
            f" [anchor: 1/{anchor} = {1 / anchor:.4f}×]" if anchor else "")
        store = root / f"store-{n}"
        box: list = [None]
        try:
            times: dict[str, list[float]] = {"cold": [], "restart": []}
            sources: list[str] = []
            prompt_tokens: list[int] = []
            growth: list[int] = []
            kv_bytes = 0
            for rep in range(max(1, min(ctx.reps, 2))):  # long prefills: one or two repetitions, no warm-up
                system = tiny.words(n - 16, salt=300 + rep)
                first = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
                if synthesized:
                    count = synthesize(store, model, first, seed=300 + rep)
                    prompt_tokens.append(count)
                    box[0] = h.Server(model, store, root / f"server-{n}-{rep}-0.log")
                    box[0].chat([{"role": "user", "content": "warm"}], max_tokens=1)
                else:
                    if box[0] is None:
                        box[0] = h.Server(model, store, root / f"server-{n}-{rep}-0.log")
                        box[0].chat([{"role": "user", "content": "warm"}], max_tokens=1)
                    cold_ms, usage = _ttft(box[0], first)
                    prompt_tokens.append(usage["prompt_tokens"])
                    times["cold"].append(cold_ms)
                    queued = box[0].log().count("kvshelf write-behind queued tokens=")
                    box[0].wait_log(h.SAVED_LINE, count=queued, timeout=3600)
                box[0].kill()
                restart_ms, source, grown, cached = _restart(
                    h, tiny, box, model, store, root / f"server-{n}-{rep}-1.log",
                    [{"role": "system", "content": system}, {"role": "user", "content": "world"}])
                sources.append(source)
                times["restart"].append(restart_ms)
                growth.append(grown)
                kv_bytes = max(kv_bytes, cached * per_token)  # the restored prefix's KV
                if not synthesized:
                    continue
                queued = box[0].log().count("kvshelf write-behind queued tokens=")  # before the next session
                box[0].wait_log(h.SAVED_LINE, count=queued, timeout=3600)
                box[0].kill()
                box[0] = None
            if box[0] is not None:
                box[0].kill()
                box[0] = None
            if any(s != "disk" for s in sources):
                rows.append(failed("36", row_name, f"restart requests not served from disk: {sources}"))
                continue
            restore_s, raw_s, nbytes = _restore_rows(ctx, store, model)
            gbs = {"restore_GBps": round(nbytes / (restore_s.median / 1e3) / 1e9, 3),
                   "raw_read_GBps": round(nbytes / (raw_s.median / 1e3) / 1e9, 3), "cache_bytes": nbytes}
            restart = Sample("ms", times["restart"])
            memory = {"server_peak_growth_bytes": growth, "prompt_kv_bytes": kv_bytes,
                      "server_peak_growth_over_kv": round(max(growth) / kv_bytes, 3) if kv_bytes else None}
            extra: dict = {"kv_synthesized": synthesized, **gbs, **memory}
            if synthesized:
                cold = None
                baseline_name = "cold prefill NOT measured (KV synthesized: a CPU prefill at this length takes hours)"
                if measured_prefill is not None:
                    m, ms = measured_prefill
                    bound = ms * max(prompt_tokens) / m
                    extra.update(cold_prefill_linear_lower_bound_ms=round(bound),
                                 cold_prefill_extrapolated_from=f"measured {m}-token prefill × {max(prompt_tokens)}/{m} "
                                                                "(an extrapolation, NOT measured)",
                                 restart_over_extrapolated_bound=round(restart.median / bound, 5))
                    baseline_name += f"; extrapolated linear lower bound {bound / 1e3:.0f} s (NOT measured)"
            else:
                cold = Sample("ms", times["cold"])
                baseline_name = "cold prefill"
                measured_prefill = (max(prompt_tokens), cold.median)
                extra["speedup"] = cold.median / restart.median if restart.median else None
            ctx.facts[f"long_context_{n}"] = {"prompt_tokens": prompt_tokens, "sources": sources, **extra}
            rows.append(Row("36", f"{row_name}, {max(prompt_tokens)}-token prompt; server peak +"
                                  f"{max(growth) / 2**20:.0f} MiB for {kv_bytes / 2**20:.0f} MiB of KV",
                            restart, cold, baseline_name, "(report)", check="none", extra=extra))
            rows.append(Row("36", f"… cold restore + eval ({gbs['restore_GBps']} GB/s) vs raw read of its pack files "
                                  f"({gbs['raw_read_GBps']} GB/s), {nbytes / 2**20:.0f} MiB", restore_s, raw_s,
                            "raw read of the same files, page cache dropped", "(report)", check="none", extra=gbs))
        except Exception as exc:  # noqa: BLE001 - a failed row (the run exits non-zero)
            rows.append(failure_row("36", row_name, exc, target="(report)"))
        finally:
            if box[0] is not None:
                box[0].kill()
            remove(store)
    return rows


def _kv_per_token(model: Path) -> int:
    """Bytes of KV per token of the model (keys and values of every layer, in its weights' dtype)."""
    import json

    import mlx.core as mx

    config = json.loads((model / "config.json").read_text())
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    weights = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
    itemsize = next(v.dtype for k, v in weights.items() if k.endswith("k_proj.weight")).size
    return config["num_hidden_layers"] * config["num_key_value_heads"] * dim * 2 * itemsize


__all__ = ["run"]
