"""Measure 31 (on request): ``kvshelf serve``'s time to first token for a long prompt, from each tier.

Real server processes on 127.0.0.1, a real HTTP client, a tiny seeded llama directory
(``tests/helpers/tiny_model_dir.py``, the same fixture the serving tests use) sized so a long prompt's prefill takes a
second or more on this CPU.
Every repetition uses a fresh long system prompt and four short user turns after it, each request with
``max_tokens=1`` (its latency is the time to first token):

* **cold**: the first request with that system prompt, on a warm server process (model loaded): full prefill;
* **RAM hit**: the same server again (mlx-lm's ``LRUPromptCache`` holds the system-prompt checkpoint);
* **disk, second server**: another server process on the same store, alive all along (its RAM never saw it);
* **disk, after restart**: the first server SIGKILLed once its write-behinds were durable, restarted on the store
  (one untimed short request first, so process warm-up is not counted), then asked.

Targets: disk after restart ≤ 0.25× cold and ≤ 2× the RAM hit. The prefix source of every timed
request is read from the server's log line and recorded; a repetition whose disk request was not served from disk
is a failed row (and a failed run) rather than a wrong figure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .context import Context
from .harness import Row, Sample, failed, failure_row

_HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"
USER = ["hello world what is the cache", "and the disk of the store", "one more short question",
        "what is a prefix of a prompt"]
PROMPT_TOKENS = {"small": 200}  # other sizes: 1500


def _harness():
    if str(_HELPERS) not in sys.path:
        sys.path.insert(0, str(_HELPERS))
    import serve_harness
    import tiny_model_dir

    return serve_harness, tiny_model_dir


def _ttft(server, messages, prompt_tokens: list[int]) -> float:
    t0 = time.perf_counter()
    reply = server.chat(messages, max_tokens=1)
    elapsed = (time.perf_counter() - t0) * 1e3
    prompt_tokens.append(reply["prompt_tokens"])
    return elapsed


def _source(server) -> str:
    """Where the last request's prefix came from: ram/disk when it covered most of the prompt, else none."""
    line = server.prefix_lines()[-1]
    return line["source"] if line["cached"] * 2 >= line["prompt"] else "none"


def _drain(server, saved_line) -> None:
    """Wait until every write-behind the server queued so far is durable (its log says so)."""
    queued = server.log().count("kvshelf write-behind queued tokens=")
    server.wait_log(saved_line, count=queued, timeout=600)


def run(ctx: Context, only: set[str]) -> list[Row]:
    name = "serve: TTFT, disk hit after restart vs cold"
    try:
        import mlx_lm  # noqa: F401

        from kvshelf.mlx_lm.serve.server import main as _main  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - no mlx-lm: the row says so (a real error fails)
        return [failure_row("31", name, exc, target="≤ 0.25× cold")]
    h, tiny = _harness()
    small = ctx.workload.name == "small"
    n_words = PROMPT_TOKENS.get(ctx.workload.name, 1500)
    root = ctx.scratch.fresh("serve")
    root.mkdir()
    model = tiny.make_model_dir(root / "model", "llama" if small else "llama-bench", seed=11)
    store = root / "store"
    times: dict[str, list[float]] = {"cold": [], "ram": [], "second": [], "restart": []}
    sources: dict[str, list[str]] = {k: [] for k in times}
    prompt_tokens: list[int] = []
    first = h.Server(model, store, root / "first-0.log")
    second = h.Server(model, store, root / "second.log")
    try:
        for label in ("warm-a", "warm-b"):  # untimed: the first request of a process compiles and allocates
            first.chat([{"role": "user", "content": label}], max_tokens=1)
            second.chat([{"role": "user", "content": label}], max_tokens=1)
        for rep in range(ctx.reps + 1):  # the first repetition is the warm-up
            system = tiny.words(n_words, salt=100 + rep)
            msgs = [[{"role": "system", "content": system}, {"role": "user", "content": u}] for u in USER]
            got = {"cold": _ttft(first, msgs[0], prompt_tokens)}
            sources_now = {"cold": _source(first)}
            got["ram"] = _ttft(first, msgs[1], prompt_tokens)
            sources_now["ram"] = _source(first)
            _drain(first, h.SAVED_LINE)
            got["second"] = _ttft(second, msgs[2], prompt_tokens)
            sources_now["second"] = _source(second)
            _drain(first, h.SAVED_LINE)
            first.kill()
            first = h.Server(model, store, root / f"first-{rep + 1}.log")
            first.chat([{"role": "user", "content": "warm"}], max_tokens=1)
            got["restart"] = _ttft(first, msgs[3], prompt_tokens)
            sources_now["restart"] = _source(first)
            if rep == 0:
                continue
            for k, series in times.items():
                series.append(got[k])
                sources[k].append(sources_now[k])
    except Exception as exc:  # noqa: BLE001 - a failed row (the run exits non-zero)
        return [failure_row("31", name, exc, target="≤ 0.25× cold")]
    finally:
        first.kill()
        second.kill()
    ctx.facts["serve"] = {"prompt_words": n_words, "model": "llama" if small else "llama-bench",
                          "sources": sources}
    # cold: nothing worth naming (mlx-lm's trie may trim another prompt down to the shared "<|system|>" token)
    expected = {"cold": "none", "ram": "ram", "second": "disk", "restart": "disk"}
    wrong = {k: s for k, s in sources.items() if any(x != expected[k] for x in s)}
    if wrong:
        return [failed("31", name, f"prefix sources not as expected: {wrong}", target="≤ 0.25× cold")]
    s = {k: Sample("ms", v) for k, v in times.items()}
    tokens = f"{max(prompt_tokens)}-token prompt"
    extra = {"sources": sources, "cold_prefill_ge_1s": s["cold"].median >= 1000.0}
    return [
        Row("31", f"{name} ({tokens})", s["restart"], s["cold"], "cold prefill", "≤ 0.25× cold", 0.25, extra=extra),
        Row("31", "… disk hit after restart vs RAM hit", s["restart"], s["ram"], "RAM hit (LRUPromptCache)",
            "≤ 2× RAM hit", 2.0),
        Row("31", "… disk hit from a second server vs cold", s["second"], s["cold"], "cold prefill", "(report)",
            check="none"),
        Row("31", "… RAM hit vs cold", s["ram"], s["cold"], "cold prefill", "(report)", check="none"),
    ]
