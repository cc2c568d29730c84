"""Measure 32 (on request): what running ``kvshelf serve`` for months costs and saves — warm-up, instrumentation,
duplicate writes.

Real server processes on 127.0.0.1, a real HTTP client, the tiny seeded llama directories of the serving tests
(``llama-bench`` for the warm-up row, so a long prompt's prefill takes a second or more on this CPU):

* **TTFT of the first request after a start, cold vs ``--warm-prompts``**: each repetition a fresh long system
  prompt and a fresh store; a server started plainly and one started with a warm-prompts file naming that
  conversation each get one untimed short request (process warm-up), then the conversation's first request
  (``max_tokens=1``: its latency is the time to first token). Target ≤ 0.05× cold.
* **``/metrics`` and the header on a RAM hit**: the same RAM-hit request to ``kvshelf serve`` (``X-Kvshelf-Prefix``
  header, metrics observed, and ``/metrics`` scraped before every request as Prometheus would) and to plain
  ``mlx_lm.server`` (no store, no instrumentation), interleaved. Target ≤ 2% over plain (ratio ≤ 1.02).
* **bytes written per replayed conversation**: a 3-turn conversation on one server, then the same requests
  replayed on a restarted server on that store; ``kvshelf_bytes_written_total`` of the replaying server once its
  write queue is empty. Target 0 (the first pass's bytes are the baseline shown).
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path

from .context import Context
from .harness import Row, Sample, failed, failure_row

_TESTS = Path(__file__).resolve().parents[1] / "tests" / "helpers"
USER = ["hello world what is the cache", "and the disk of the store", "one more short question"]


def _harness():
    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))
    import serve_harness
    import tiny_model_dir

    return serve_harness, tiny_model_dir


def _get(server, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def _metric(server, sample: str) -> float:
    text = _get(server, "/metrics").decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample + " "))


def _idle(server) -> None:
    """Until the server's write queue is empty (its status document says so)."""
    while json.loads(_get(server, "/kvshelf/stats"))["write_queue"]["pending"]:
        time.sleep(0.05)


def _ttft(server, messages) -> float:
    t0 = time.perf_counter()
    server.chat(messages, max_tokens=1)
    return (time.perf_counter() - t0) * 1e3


def _warm_rows(ctx: Context, h, tiny, root: Path) -> list[Row]:
    name = "serve: TTFT of the first request after start, --warm-prompts vs cold"
    model = tiny.make_model_dir(root / "bench-model", "llama-bench", seed=11)
    cold, warm, sources = [], [], []
    for rep in range(ctx.reps + 1):
        msgs = [{"role": "system", "content": tiny.words(1500, salt=300 + rep)}, {"role": "user", "content": USER[0]}]
        wfile = root / f"warm-{rep}.jsonl"
        wfile.write_text(json.dumps({"messages": msgs}) + "\n")
        with h.Server(model, root / f"cold-{rep}", root / f"cold-{rep}.log") as a:
            a.chat([{"role": "user", "content": "warm"}], max_tokens=1)
            t_cold = _ttft(a, msgs)
        with h.Server(model, root / f"warm-{rep}", root / f"warm-{rep}.log",
                      extra=("--warm-prompts", str(wfile))) as b:
            b.chat([{"role": "user", "content": "warm"}], max_tokens=1)
            t_warm = _ttft(b, msgs)
            line = b.prefix_lines()[-1]
        if rep == 0:
            continue
        cold.append(t_cold)
        warm.append(t_warm)
        sources.append(line["source"])
    if any(s not in ("disk", "ram") for s in sources):
        return [failed("32", name, f"warmed first requests were not store hits: {sources}",
                       target="≤ 0.05× cold")]
    return [Row("32", name, Sample("ms", warm), Sample("ms", cold), "cold first request", "≤ 0.05× cold", 0.05,
                extra={"sources": sources})]


def _overhead_rows(ctx: Context, h, tiny, root: Path) -> list[Row]:
    name = "serve: RAM hit with X-Kvshelf-Prefix + a /metrics scrape, vs plain mlx_lm.server"
    model = tiny.make_model_dir(root / "model", "llama", seed=11)
    msgs = [{"role": "system", "content": tiny.words(200, salt=7)}, {"role": "user", "content": USER[0]}]
    ours, plain = [], []
    with h.Server(model, root / "overhead-store", root / "ours.log") as k, \
            h.Server(model, None, root / "plain.log") as p:
        for server in (k, p):
            server.chat(msgs, max_tokens=1)
        _idle(k)
        n = max(20, 10 * ctx.reps)
        for i in range(n + 5):
            _get(k, "/metrics")
            t_k = _ttft(k, msgs)
            t_p = _ttft(p, msgs)
            if i >= 5:
                ours.append(t_k)
                plain.append(t_p)
        sources = {line["source"] for line in k.prefix_lines()[1:]}
    if sources != {"ram"}:
        return [failed("32", name, f"not RAM hits: {sources}", target="≤ 1.02× plain")]
    return [Row("32", name, Sample("ms", ours), Sample("ms", plain), "plain mlx_lm.server RAM hit",
                "≤ 1.02× plain (≤ 2%)", 1.02)]


def _replay_rows(ctx: Context, h, tiny, root: Path) -> list[Row]:
    name = "serve: bytes written per replayed conversation"
    model = tiny.make_model_dir(root / "model", "llama", seed=11)
    first_pass, replayed = [], []
    for rep in range(ctx.reps):
        store = root / f"replay-{rep}"
        system = tiny.words(200, salt=500 + rep)
        turns: list[list[dict]] = []
        with h.Server(model, store, root / f"replay-a-{rep}.log") as a:
            msgs = [{"role": "system", "content": system}]
            for user in USER:
                msgs = [*msgs, {"role": "user", "content": user}]
                turns.append(msgs)
                reply = a.chat(msgs, max_tokens=4)
                msgs = [*msgs, {"role": "assistant", "content": reply["text"]}]
            _idle(a)
            first_pass.append(_metric(a, "kvshelf_bytes_written_total"))
        with h.Server(model, store, root / f"replay-b-{rep}.log") as b:
            for msgs in turns:
                b.chat(msgs, max_tokens=4)
            _idle(b)
            replayed.append(_metric(b, "kvshelf_bytes_written_total"))
    return [Row("32", name, Sample("bytes", replayed), Sample("bytes", first_pass), "first pass (bytes written)",
                "0 bytes", 0.0, check="value")]


def run(ctx: Context, only: set[str]) -> list[Row]:
    try:
        import mlx_lm  # noqa: F401
        import prometheus_client  # noqa: F401

        from kvshelf.mlx_lm.serve.server import main as _main  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - no mlx-lm / prometheus_client: the row says so
        return [failure_row("32", "serve: warm-up, instrumentation, duplicate writes", exc)]
    h, tiny = _harness()
    root = ctx.scratch.fresh("serve-ops")
    root.mkdir()
    rows: list[Row] = []
    for part in (_warm_rows, _overhead_rows, _replay_rows):
        try:
            rows += part(ctx, h, tiny, root)
        except Exception as exc:  # noqa: BLE001 - a failed row (the run exits non-zero)
            rows.append(failure_row("32", f"serve: {part.__name__.strip('_')}", exc))
    return rows
