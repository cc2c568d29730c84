"""Measure 35 (on request: ``--only 35``): what tenant isolation costs in ``kvshelf serve``.

Real server processes on 127.0.0.1, a real HTTP client, the tiny seeded llama directories of the serving tests:

* **A RAM hit with a ``cache_salt`` vs the same RAM hit without one**: one server, the same conversation sent
  once unsalted and once with a salt (each then a RAM hit in its own scope), then timed interleaved with
  ``max_tokens=1`` (the request's latency is its time to first token). The salt adds a parse, a digest and a
  longer RAM key. Target ≤ 1.02×.
* **The TTFT cost of isolation on a shared system prompt**: 6 tenants each with their own conversation after the
  same long system prompt (``llama-bench``, 1,500 words). Shared (every request the default tenant): the first
  tenant prefills the system prompt and the others reuse its segment from RAM; isolated (each its own
  ``X-Kvshelf-Tenant``): each tenant's first request prefills it again. Reported: the median first-request TTFT
  of tenants 2–6, isolated ÷ shared (no target: this is the price of not leaking the system prompt's presence;
  an operator who wants tenants to share a system prompt sends them with the same tenant and salt).
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

from .context import Context
from .harness import Row, Sample, failed, failure_row, time_interleaved
from .serve_ops import USER, _harness


def _post(server, body: dict, headers: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
        return json.loads(raw)
    finally:
        conn.close()


def _ttft(server, msgs, *, salt: str | None = None, tenant: str | None = None) -> float:
    body = {"messages": msgs, "max_tokens": 1, "temperature": 0.0, **({"cache_salt": salt} if salt else {})}
    t0 = time.perf_counter()
    _post(server, body, {"X-Kvshelf-Tenant": tenant} if tenant else None)
    return (time.perf_counter() - t0) * 1e3


def _salt_rows(ctx: Context, h, tiny, root: Path) -> list[Row]:
    name = "tenants: RAM hit with cache_salt vs without"
    model = tiny.make_model_dir(root / "model", "llama", seed=11)
    msgs = [{"role": "system", "content": tiny.words(200, salt=9)}, {"role": "user", "content": USER[0]}]
    with h.Server(model, root / "salt-store", root / "salt.log") as k:
        _ttft(k, msgs)
        _ttft(k, msgs, salt="team-a")
        n = max(20, 10 * ctx.reps)
        times = time_interleaved({"salted": lambda _: _ttft(k, msgs, salt="team-a"),
                                  "plain": lambda _: _ttft(k, msgs)}, n, warmup=3, collect=False)
        sources = {line["source"] for line in k.prefix_lines()[2:]}
    if sources != {"ram"}:
        return [failed("35", name, f"not RAM hits: {sources}", target="≤ 1.02×")]
    return [Row("35", name, times["salted"], times["plain"], "the same RAM hit without a salt", "≤ 1.02×", 1.02)]


def _isolation_rows(ctx: Context, h, tiny, root: Path) -> list[Row]:
    name = "tenants: TTFT of a tenant's first request after a shared system prompt, isolated vs shared"
    model = tiny.make_model_dir(root / "bench-model", "llama-bench", seed=11)
    isolated, shared = [], []
    for rep in range(ctx.reps):
        system = tiny.words(1500, salt=700 + rep)
        convs = [[{"role": "system", "content": system}, {"role": "user", "content": f"{USER[i % 3]} {i}"}]
                 for i in range(6)]
        for mode, into in (("shared", shared), ("isolated", isolated)):
            with h.Server(model, root / f"{mode}-{rep}", root / f"{mode}-{rep}.log") as s:
                s.chat([{"role": "user", "content": "warm"}], max_tokens=1)
                firsts = [_ttft(s, c, tenant=f"t{i}" if mode == "isolated" else None) for i, c in enumerate(convs)]
            into.extend(firsts[1:])
    return [Row("35", name, Sample("ms", isolated), Sample("ms", shared), "shared (one tenant)", "report", None)]


def run(ctx: Context, only: set[str]) -> list[Row]:
    try:
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        return [failure_row("35", "tenants", exc)]
    h, tiny = _harness()
    root = ctx.scratch.fresh("tenants")
    root.mkdir()
    rows: list[Row] = []
    for part in (_salt_rows, _isolation_rows):
        try:
            rows += part(ctx, h, tiny, root)
        except Exception as exc:  # noqa: BLE001 - one part failing must not hide the other's figures
            rows.append(failure_row("35", f"tenants ({part.__name__})", exc))
    return rows
