"""Measure 42 (on request): a burst of concurrent greedy requests on ``kvshelf serve`` with generation checkpoints,
against plain ``mlx_lm.server``.

Why: resumable (greedy or seeded) requests with ``--generation-checkpoint-every`` are rows of mlx-lm's batch
(``kvshelf/mlx_lm/serve/batch_rows.py``), checkpointed at step boundaries and written behind; this is what that costs
a burst of concurrent users. Real server processes on 127.0.0.1 (the serving tests' harness), a tiny seeded llama
directory, 8 requests sent at once, each greedy with ``max_tokens=512`` and EOS biased away (each makes 512 tokens:
checked), a distinct system prompt per request and per repetition (every burst prefills and decodes the same work on
every server). Three servers alive all along: plain ``mlx_lm.server``, ``kvshelf serve --generation-checkpoint-every
256`` and ``kvshelf serve --generation-checkpoint-every 0``; the repetitions interleave them (one burst each per
repetition, the order rotating), after one untimed burst each. Figure: the burst's wall time, medians.

Target: with checkpoints ≤ 1.10× plain; without them reported.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .context import Context
from .harness import Row, Sample, failure_row

_HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"
BURST = 8
MAX_TOKENS = 512
EVERY = 256
TARGET = "≤ 1.10× plain"


def _harness():
    if str(_HELPERS) not in sys.path:
        sys.path.insert(0, str(_HELPERS))
    import serve_harness
    import tiny_model_dir

    return serve_harness, tiny_model_dir


def _ask(port: int, body: dict) -> int:
    """One chat completion; its completion token count."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
        return int(json.loads(raw)["usage"]["completion_tokens"])
    finally:
        conn.close()


def _burst(server, bodies: list[dict]) -> float:
    """Wall time (ms) of the requests sent at once; each must have made ``MAX_TOKENS`` tokens."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        made = list(pool.map(lambda b: _ask(server.port, b), bodies))
    elapsed = (time.perf_counter() - t0) * 1e3
    if any(n != MAX_TOKENS for n in made):
        raise RuntimeError(f"a request did not make {MAX_TOKENS} tokens: {made}")
    return elapsed


def run(ctx: Context, only: set[str]) -> list[Row]:
    name = (f"serve: burst of {BURST} greedy requests × {MAX_TOKENS} tokens, --generation-checkpoint-every {EVERY} "
            "vs plain")
    try:
        import mlx_lm  # noqa: F401

        from kvshelf.mlx_lm.serve.server import main as _main  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - no mlx-lm: the row says so (a real error fails)
        return [failure_row("42", name, exc, target=TARGET)]
    h, tiny = _harness()
    small = ctx.workload.name == "small"
    arch = "llama" if small else "llama-bench"
    root = ctx.scratch.fresh("batched_resume")
    root.mkdir()
    model = tiny.make_model_dir(root / "model", arch, seed=11)
    eos = str(tiny.VOCAB.index(tiny.EOS))

    def bodies(rep: int) -> list[dict]:
        return [{"model": "default_model", "max_tokens": MAX_TOKENS, "temperature": 0.0, "logit_bias": {eos: -100.0},
                 "messages": [{"role": "system", "content": tiny.words(60, salt=1000 * rep + i)},
                              {"role": "user", "content": "tell me a long story"}]} for i in range(BURST)]

    servers: dict[str, object] = {}
    times: dict[str, list[float]] = {"plain": [], "every": [], "off": []}
    try:
        servers["plain"] = h.Server(model, None, root / "plain.log")
        servers["every"] = h.Server(model, root / "store-every", root / "every.log",
                                    extra=("--generation-checkpoint-every", str(EVERY)))
        servers["off"] = h.Server(model, root / "store-off", root / "off.log",
                                  extra=("--generation-checkpoint-every", "0"))
        order = list(servers)
        for key in order:  # untimed: process warm-up
            _burst(servers[key], bodies(0))
        for rep in range(1, ctx.reps + 1):
            for key in order[rep % 3:] + order[:rep % 3]:
                times[key].append(_burst(servers[key], bodies(rep)))
        every_log = servers["every"].log()
        checkpoints = every_log.count("kvshelf generation checkpoint tokens=")
    except Exception as exc:  # noqa: BLE001 - a failed row (the run exits non-zero)
        return [failure_row("42", name, exc, target=TARGET)]
    finally:
        for server in servers.values():
            server.kill()
    s = {k: Sample("ms", v) for k, v in times.items()}
    ctx.facts["batched_resume"] = {"burst": BURST, "max_tokens": MAX_TOKENS, "every": EVERY, "model": arch,
                                   "durable_checkpoints": checkpoints}
    return [
        Row("42", name, s["every"], s["plain"], "plain mlx_lm.server", TARGET, 1.10),
        Row("42", "… with --generation-checkpoint-every 0 vs plain", s["off"], s["plain"], "plain mlx_lm.server",
            "(report)", check="none"),
    ]
