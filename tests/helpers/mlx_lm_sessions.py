"""Sessions of tiny mlx-lm models on mlx-lm's own caches: what is saved, how it continues, and the child process
that restores them (``python tests/helpers/mlx_lm_sessions.py PLAN.json OUT.npz``).

Why a module: the saver (the test process) and the restorer (a fresh process) must run the very same computation
— the same model, the same session, the same continuation steps — so that "bit-identical to an uninterrupted run"
compares like with like. Every case is one model plus a way to build its caches and to continue a run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm_models import PROMPT, build, forward, greedy, quantized_cache

STEPS = 4
KV_BITS = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)  # noqa: C408


@dataclass(frozen=True)
class Case:
    """One model and its caches; ``trimmable`` is what the prefix rule says about a cut inside the session."""

    name: str
    model: str
    make: Callable
    trimmable: bool
    kv_bits: bool = False


CASES = {c.name: c for c in (
    Case("llama", "llama", make_prompt_cache, True),
    Case("qwen3", "qwen3", make_prompt_cache, True),
    Case("qwen3_window", "qwen3", lambda m: make_prompt_cache(m, max_kv_size=32), True),   # RotatingKVCache, unwrapped
    Case("qwen3_wrapped", "qwen3", lambda m: make_prompt_cache(m, max_kv_size=8), False),  # the ring wrapped
    Case("deepseek_v3", "deepseek_v3", make_prompt_cache, True),
    Case("glm_moe_dsa", "glm_moe_dsa", make_prompt_cache, True),      # CacheList(KVCache, KVCache)
    Case("gemma3_text", "gemma3_text", make_prompt_cache, False),     # sliding RotatingKVCache wrapped + KVCache
    Case("qwen3_next", "qwen3_next", make_prompt_cache, False),       # ArraysCache + KVCache
    Case("mamba", "mamba", make_prompt_cache, False),
    Case("mamba2", "mamba2", make_prompt_cache, False),
    Case("llama_qkv", "llama", quantized_cache, True),                # QuantizedKVCache from the start
    Case("llama_kv_bits", "llama", make_prompt_cache, True, kv_bits=True),  # generate_step(kv_bits=8)
)}

_MODELS: dict[str, object] = {}


def model_of(case: Case):
    if case.model not in _MODELS:
        _MODELS[case.model] = build(case.model)
    return _MODELS[case.model]


def session(case: Case) -> tuple[list[int], list, int]:
    """Run the session: (tokens the caches now encode, the caches, the next input token)."""
    model = model_of(case)
    cache = case.make(model)
    if case.kv_bits:
        out = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=STEPS, prompt_cache=cache,
                                                **KV_BITS)]
        return PROMPT + out, cache, 7  # mlx-lm runs one step ahead: every yielded token is already in the cache
    tokens, _ = greedy(model, PROMPT, cache, steps=STEPS)
    return PROMPT + tokens[:STEPS], cache, tokens[STEPS]


def run(case: Case, cache, inputs: list[int], steps: int) -> tuple[list[int], list[mx.array]]:
    """Feed ``inputs`` in one forward, then ``steps`` greedy steps: (tokens chosen, float32 logits per step)."""
    model = model_of(case)
    if case.kv_bits:
        tokens, logits = [], []
        for token, logprobs in generate_step(mx.array(inputs), model, max_tokens=steps + 1, prompt_cache=cache,
                                             **KV_BITS):
            tokens.append(int(token))
            logits.append(logprobs.astype(mx.float32)[None])
        return tokens, logits
    logits = [forward(model, inputs, cache)]
    tokens = [int(mx.argmax(logits[-1], axis=-1).item())]
    for _ in range(steps):
        logits.append(forward(model, [tokens[-1]], cache))
        tokens.append(int(mx.argmax(logits[-1], axis=-1).item()))
    return tokens, logits


def prompts(tokens: list[int], nxt: int) -> dict[str, list[int]]:
    """The prompts restore_prefix is asked about: one that extends the session, one cut inside it, one that
    diverges from it."""
    return {"extend": tokens + [nxt, 7, 9], "cut": tokens[:12], "diverge": tokens[:6] + [1, 2, 3]}


def expected_length(case: Case, tokens: list[int], prompt: list[int]) -> int | None:
    """The prefix rule: p = min(lcp, len(prompt) - 1); the whole session, or a cut only when trimmable."""
    lcp = 0
    while lcp < min(len(tokens), len(prompt)) and tokens[lcp] == prompt[lcp]:
        lcp += 1
    p = min(lcp, len(prompt) - 1)
    if p <= 0 or (p < len(tokens) and not case.trimmable):
        return None
    return p


def child(plan_path: str, out_path: str) -> None:
    """In a fresh process: restore every case's session (store, prefix lookups, snapshot file) and continue."""
    from kvshelf import Identity, open_store
    from kvshelf.codecs import load_snapshot

    plan = json.loads(Path(plan_path).read_text())
    out: dict[str, np.ndarray] = {}
    classes: dict[str, list[str]] = {}

    def record(key: str, result: tuple[list[int], list[mx.array]]) -> None:
        out[f"{key}/tokens"] = np.array(result[0], dtype=np.int64)
        out[f"{key}/logits"] = np.stack([np.array(x) for x in result[1]])

    for name, info in plan["cases"].items():
        case = CASES[name]
        with open_store(plan["store"], identity=Identity(name)) as store:
            restored = store.restore(name)
            classes[name] = [type(c).__name__ for c in restored.caches]
            record(f"{name}/restore", run(case, restored.caches, [info["next"]], 3))
            for kind, prompt in prompts(info["tokens"], info["next"]).items():
                hit = store.restore_prefix(prompt)
                out[f"{name}/{kind}/length"] = np.array(-1 if hit is None else hit.length)
                if hit is not None:
                    record(f"{name}/{kind}", run(case, hit.caches, prompt[hit.length:], 2))
        snap = load_snapshot(info["file"], expect={"model_id": name})
        record(f"{name}/file", run(case, snap.caches, [info["next"]], 3))
    out["classes"] = np.array(json.dumps(classes))
    np.savez(out_path, **out)


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
