"""Measure 34 (on request): checkpoints along the prompt for models whose caches cannot be cut.

The tiny seeded qwen3_next (recurrent ``ArraysCache`` layers beside attention) of the tests, nothing downloaded:

* **tokens reused per request, thinking-style conversation**: a replayed agentic chat on real ``kvshelf serve``
  processes behind the tests' thinking template (``tiny_model_dir.THINKING_TEMPLATE``: a tool step keeps its
  reasoning until the next user message, which re-renders it without): four turns of an agent, each a long user
  message, a tool step and its result, each request ending with the tool result (so mlx-lm's server, which splits
  only prompts that end with a user message, inserts no cache before the tool step that the next turn re-renders).
  For every request after the first: the prompt tokens served from a cache tier (the server's own ``kvshelf
  prefix`` log line) over the prefix it shares with an earlier request's prompt. Baseline: the same replay with
  ``--checkpoint-every 0``. Target: ≥ 80 % of the shared prefix. (When a request ends with the user message,
  mlx-lm 0.32's own segment insert already covers the re-rendered tool step: checkpoints add nothing there.)
* **prefill with checkpoints vs mlx-lm's own**: a 4,000-token prompt through ``kvshelf.mlx_lm.prefill(every=1024)``
  collecting a copy of the recurrent state at every 1,024 tokens, vs mlx-lm's ``generate_step`` prefill of the same
  prompt (both end with the last token's forward), interleaved, medians. Target ≤ 1.05×.
* **bytes per checkpoint vs the session's bytes**: the same 4,000-token session saved, then its three checkpoints
  (counted: the store's ``bytes_written``). Shown, no target (the recurrent state alone is new).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .context import Context
from .harness import Row, Sample, failure_row

_TESTS = Path(__file__).resolve().parents[1] / "tests"
LENGTH, EVERY = 4000, 1024


def _helpers():
    for p in (_TESTS, _TESTS / "helpers"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    import mlx_lm_models
    import serve_harness
    import tiny_model_dir

    return mlx_lm_models, serve_harness, tiny_model_dir


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _idle(server) -> None:
    """Until the server's write queue is empty (its status document says so)."""
    import http.client
    import json

    while True:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            conn.request("GET", "/kvshelf/stats")
            if not json.loads(conn.getresponse().read())["write_queue"]["pending"]:
                return
        finally:
            conn.close()
        time.sleep(0.05)


def _replay(h, tiny, model: Path, store: Path, log: Path, every: int, tokenizer) -> tuple[int, int, list]:
    """(tokens served from a cache, tokens shared with an earlier prompt, per-request pairs) of one replay."""
    msgs = [{"role": "system", "content": tiny.words(40, salt=900)}]
    prompts, pairs = [], []
    with h.Server(model, store, log, extra=("--checkpoint-every", str(every))) as server:
        for turn in range(4):  # an agent's turns: a long user message, a tool step (with reasoning), its result
            msgs = [*msgs, {"role": "user", "content": tiny.words(1100, salt=910 + turn)},
                    {"role": "assistant", "content": "store find the cache"}, {"role": "tool", "content": "water oil"}]
            prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            prompts.append(list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt))
            reply = server.chat(msgs, max_tokens=4)
            _idle(server)  # the user's think time: the write-behind of this turn is on disk before the next
            msgs = [*msgs, {"role": "assistant", "content": reply["text"] or "ok"}]
        lines = server.prefix_lines()
    cached = shared = 0
    for i in range(1, len(prompts)):
        s = max(_common(prompts[i], p) for p in prompts[:i])
        s = min(s, len(prompts[i]) - 1)
        pairs.append((lines[i]["cached"], s))
        cached += min(lines[i]["cached"], s)
        shared += s
    return cached, shared, pairs


def _reuse_rows(ctx: Context, h, tiny, root: Path) -> list[Row]:
    from transformers import AutoTokenizer

    name = "checkpoints: tokens reused / shared prefix, thinking-style replay on qwen3_next (serve)"
    model = tiny.make_model_dir(root / "qwen3_next", "qwen3_next", seed=21, chat_template=tiny.THINKING_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ours, base, detail = [], [], {}
    for rep in range(ctx.reps):
        for every, into in ((EVERY, ours), (0, base)):
            cached, shared, pairs = _replay(h, tiny, model, root / f"store-{every}-{rep}",
                                            root / f"serve-{every}-{rep}.log", every, tokenizer)
            into.append(cached / shared if shared else 0.0)
            detail[f"every={every} rep={rep}"] = pairs
    value = Sample("fraction", ours)
    return [Row("34", name, value, Sample("fraction", base), "--checkpoint-every 0 (mlx-lm's segments only)",
                "≥ 0.80 of the shared prefix", 0.80, check="ratio-min", ratio=value.median,
                extra={"requests (cached, shared)": detail})]


def _prefill_rows(ctx: Context, models) -> list[Row]:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from kvshelf.mlx_lm import CheckpointCollector, prefill

    name = "checkpoints: prefill of 4,000 tokens with a checkpoint every 1,024 (qwen3_next), vs mlx-lm's"
    model = models.build("qwen3_next")
    tokens = np.random.default_rng(33).integers(0, models.VOCAB, LENGTH).tolist()

    def ours() -> float:
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        prefill(model, tokens[:-1], cache, every=EVERY, on_checkpoint=CheckpointCollector())
        mx.eval(model(mx.array([tokens[-1:]]), cache=cache))
        return (time.perf_counter() - t0) * 1e3

    def theirs() -> float:
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        for _ in generate_step(mx.array(tokens), model, max_tokens=1, prompt_cache=cache):
            pass
        return (time.perf_counter() - t0) * 1e3

    ours(), theirs()  # warm-up
    a, b = [], []
    for _ in range(max(5, 2 * ctx.reps)):
        a.append(ours())
        b.append(theirs())
    return [Row("34", name, Sample("ms", a), Sample("ms", b), "mlx-lm generate_step prefill", "≤ 1.05×", 1.05)]


def _bytes_rows(ctx: Context, models, root: Path) -> list[Row]:
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from kvshelf import Identity, open_store
    from kvshelf.mlx_lm import CheckpointCollector, prefill

    name = "checkpoints: bytes written per checkpoint vs the 4,000-token session's (qwen3_next)"
    model = models.build("qwen3_next")
    tokens = np.random.default_rng(34).integers(0, models.VOCAB, LENGTH).tolist()
    cache, collect = make_prompt_cache(model), CheckpointCollector()
    prefill(model, tokens, cache, every=EVERY, on_checkpoint=collect)
    checkpoints = collect.for_store(cache, LENGTH)
    with open_store(root / "bytes-store", identity=Identity("bench-qwen3_next")) as store:
        info = store.save("s", tokens, cache)
        before = store.counters["bytes_written"]
        for k in sorted(checkpoints):
            store.save_checkpoint("s", tokens[:k], checkpoints[k])
        per = (store.counters["bytes_written"] - before) / len(checkpoints)
    return [Row("34", name, Sample("bytes", [per]), Sample("bytes", [info.bytes_written]), "the session's bytes",
                "shown (only the recurrent state is new)", None, check="none")]


def run(ctx: Context, only: set[str]) -> list[Row]:
    try:
        import mlx_lm  # noqa: F401
        import prometheus_client  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - no mlx-lm: the row says so (a real error fails)
        return [failure_row("34", "checkpoints", exc)]
    models, h, tiny = _helpers()
    root = ctx.scratch.fresh("checkpoints")
    root.mkdir()
    rows: list[Row] = []
    for part in (lambda: _reuse_rows(ctx, h, tiny, root), lambda: _prefill_rows(ctx, models),
                 lambda: _bytes_rows(ctx, models, root)):
        try:
            rows += part()
        except Exception as exc:  # noqa: BLE001 - a failed row (the run exits non-zero)
            rows.append(failure_row("34", "checkpoints", exc))
    return rows
