"""Measure 41 (on request): an agent's trace on ``kvshelf serve`` against plain ``mlx_lm.server``.

The workload agents send (issue 31): a long system prompt plus tools, then one conversation grown by a tool call and
its result per turn, 20 turns. Each turn is a request with ``max_tokens=1`` (so its latency is the time to first
token) sent through the Messages API's translation target, ``/v1/chat/completions`` (the tests show both APIs reach
the same token ids; plain ``mlx_lm.server`` has only this route). Sides, per repetition (a fresh system prompt each,
the sides interleaved):

* **no cache**: every turn prefills its whole prompt — the sum of the prompts' tokens (counted, not run);
* **plain mlx_lm.server**: its RAM ``LRUPromptCache`` (prefilled tokens: prompt − its ``cached_tokens``);
* **kvshelf serve**: a fresh store; and the same trace on another fresh store with a SIGKILL after turn 1 (its
  writes settled): turns 2-20 on the restarted server, turn 2 its first request after an untimed warm-up.

Figures: prefilled tokens over the trace (targets: kvshelf ≤ 0.1× no cache, fresh and after the restart), the
trace's wall time against plain mlx_lm.server (reported), and turn 2's time to first token on the restarted server
(its first request after an untimed warm-up) against turn 2 on the server that served turn 1 (target ≤ 1.2×).
Prompt sizes: 2,000-word system prompt, tool results of 100–400 words (size ``small``: 300 and 20–60).
"""

from __future__ import annotations

import json
import time

from .context import Context
from .harness import Row, Sample, failure_row
from .serve import _harness

TURNS = 20
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} a word", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}} for n in ("find", "store")]


def trace(words, system_words: int, lo: int, hi: int, salt: int) -> list[list[dict]]:
    """The 20 requests of one agent run (OpenAI-shaped): each adds the previous step's call and result."""
    msgs: list[dict] = [{"role": "system", "content": words(system_words, salt=salt)},
                        {"role": "user", "content": "find the water and store the oil"}]
    turns = [list(msgs)]
    for k in range(1, TURNS):
        call = f"call_{k:02d}"
        size = lo + (k * 37) % (hi - lo + 1)
        msgs += [{"role": "assistant", "content": words(6, salt=salt + k), "tool_calls": [
                     {"id": call, "type": "function", "function": {"name": ("find", "store")[k % 2],
                                                                   "arguments": json.dumps({"q": "water"})}}]},
                 {"role": "tool", "tool_call_id": call, "content": words(size, salt=salt + 100 + k)}]
        turns.append(list(msgs))
    return turns


def _request(server, messages: list[dict]) -> tuple[float, int, int]:
    """(milliseconds, prompt tokens, cached tokens) of one max_tokens=1 request."""
    t0 = time.perf_counter()
    status, raw = server._request("POST", "/v1/chat/completions", {
        "messages": messages, "tools": TOOLS, "max_tokens": 1, "temperature": 0.0})
    ms = (time.perf_counter() - t0) * 1e3
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {raw[:200]!r}")
    usage = json.loads(raw)["usage"]
    return ms, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0


def _replay(server, turns) -> tuple[float, int, int, list[float]]:
    """(wall ms, prompt tokens, prefilled tokens, per-turn ms) of a whole trace."""
    total_ms, prompt, prefilled, each = 0.0, 0, 0, []
    for msgs in turns:
        ms, p, c = _request(server, msgs)
        total_ms += ms
        prompt += p
        prefilled += p - c
        each.append(ms)
    return total_ms, prompt, prefilled, each


def _settle(server) -> None:
    queued = server.log().count("kvshelf write-behind queued tokens=")
    done = "kvshelf write-behind (saved|failed)"
    server.wait_log(done, count=queued, timeout=600)


def run(ctx: Context, only: set[str]) -> list[Row]:
    name = "agents: 20-turn trace, prefilled tokens, kvshelf serve vs no cache"
    try:
        import mlx_lm  # noqa: F401

        from kvshelf.mlx_lm.serve.server import main as _main  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - no mlx-lm: the row says so
        return [failure_row("41", name, exc, target="≤ 0.1× no cache")]
    h, tiny = _harness()
    small = ctx.workload.name == "small"
    system_words, lo, hi = (300, 20, 60) if small else (2000, 100, 400)
    root = ctx.scratch.fresh("agents")
    root.mkdir()
    model = tiny.make_model_dir(root / "model", "llama" if small else "llama-bench", seed=12,
                                chat_template=tiny.TOOL_TEMPLATE)
    fig: dict[str, list[float]] = {k: [] for k in ("nocache", "kvshelf", "restart", "plain", "t_kvshelf", "t_plain",
                                                   "t_restart", "ttft2", "ttft2_restart")}
    try:
        for rep in range(ctx.reps + 1):  # the first repetition is the warm-up
            turns = trace(tiny.words, system_words, lo, hi, salt=200 + rep * 7)
            with h.Server(model, None, root / f"plain-{rep}.log") as plain:
                plain.chat([{"role": "user", "content": "warm"}], max_tokens=1)
                p_ms, p_prompt, p_prefilled, _ = _replay(plain, turns)
            store = root / f"store-{rep}"
            first = h.Server(model, store, root / f"first-{rep}.log")
            try:
                first.chat([{"role": "user", "content": "warm"}], max_tokens=1)
                k_ms, k_prompt, k_prefilled, k_each = _replay(first, turns)
                _settle(first)
            finally:
                first.kill()
            # the same trace with a kill -9 after turn 1: a fresh store, turn 1, its writes settled, SIGKILL; then
            # turns 2-20 on the restarted server (turn 2 its first request after an untimed warm-up)
            store = root / f"store-restart-{rep}"
            one = h.Server(model, store, root / f"turn1-{rep}.log")
            try:
                one.chat([{"role": "user", "content": "warm"}], max_tokens=1)
                t1_ms, t1_prompt, t1_prefilled, _ = _replay(one, turns[:1])
                _settle(one)
            finally:
                one.kill()
            with h.Server(model, store, root / f"restarted-{rep}.log") as again:
                again.chat([{"role": "user", "content": "warm"}], max_tokens=1)
                r_ms, r_prompt, r_prefilled, r_each = _replay(again, turns[1:])
            r_ms, r_prefilled, ttft2_restart = r_ms + t1_ms, r_prefilled + t1_prefilled, r_each[0]
            if rep == 0:
                continue
            fig["nocache"].append(k_prompt)
            fig["kvshelf"].append(k_prefilled)
            fig["restart"].append(r_prefilled)
            fig["plain"].append(p_prefilled)
            fig["t_kvshelf"].append(k_ms)
            fig["t_plain"].append(p_ms)
            fig["t_restart"].append(r_ms)
            fig["ttft2"].append(k_each[1])
            fig["ttft2_restart"].append(ttft2_restart)
    except Exception as exc:  # noqa: BLE001 - a failed row (the run exits non-zero)
        return [failure_row("41", name, exc, target="≤ 0.1× no cache")]
    s = {k: Sample("tokens" if not k.startswith("t") else "ms", v) for k, v in fig.items()}
    ctx.facts["agents"] = {"system_words": system_words, "tool_result_words": [lo, hi], "turns": TURNS,
                           "model": "llama" if small else "llama-bench"}
    return [
        Row("41", name, s["kvshelf"], s["nocache"], "no cache (every prompt token)", "≤ 0.1× no cache", 0.1),
        Row("41", "… prefilled tokens with kill -9 and a restart after turn 1 vs no cache", s["restart"], s["nocache"],
            "no cache (every prompt token)", "≤ 0.1× no cache", 0.1),
        Row("41", "… prefilled tokens vs plain mlx_lm.server (RAM LRU)", s["kvshelf"], s["plain"],
            "plain mlx_lm.server", "(report)", check="none"),
        Row("41", "… trace wall time vs plain mlx_lm.server", s["t_kvshelf"], s["t_plain"], "plain mlx_lm.server",
            "(report)", check="none"),
        Row("41", "… trace wall time with a restart after turn 1 vs plain mlx_lm.server", s["t_restart"], s["t_plain"],
            "plain mlx_lm.server", "(report)", check="none"),
        Row("41", "… TTFT of turn 2 after a restart vs without", s["ttft2_restart"], s["ttft2"],
            "turn 2 on the server that served turn 1", "≤ 1.2×", 1.2),
    ]
