"""mlx-lm users persist the caches they already have: tiny mlx-lm models (llama, qwen3 also with ``max_kv_size``,
deepseek_v3, glm_moe_dsa, gemma3_text, qwen3_next, mamba, mamba2, QuantizedKVCache, ``generate_step(kv_bits=8)``)
prefill and decode greedily on ``make_prompt_cache(model)``; the caches go into a store unchanged (``save`` and
``save_async``) and into a snapshot file. A fresh process restores them (``restore``, ``restore_prefix`` with a
prompt that extends the session, one cut inside it and one that diverges, ``load_snapshot``) and continues: tokens
and logits must be bit-identical to the uninterrupted run in this process (the live caches, trimmed by mlx-lm's
``trim_prompt_cache`` where the prompt is cut), and ``restore_prefix`` must say None exactly where the prefix rule
says (recurrent state, wrapped rings).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from mlx_lm_sessions import CASES, expected_length, prompts, run, session

from kvshelf import Identity, open_store
from kvshelf.codecs import save_snapshot

ROOT = Path(__file__).resolve().parents[2]
NAMES = list(CASES)


@pytest.fixture(scope="module")
def restored(tmp_path_factory):
    """Save every case here, restore and continue all of them in ONE fresh process; its results by key."""
    root = tmp_path_factory.mktemp("mlx-lm-sessions")
    plan = {"store": str(root / "store"), "cases": {}}
    for i, (name, case) in enumerate(CASES.items()):
        tokens, cache, nxt = session(case)
        with open_store(plan["store"], identity=Identity(name)) as store:
            if i % 2:
                store.save(name, tokens, cache)
            else:
                store.save_async(name, tokens, cache)
                store.flush()
        file = root / f"{name}.safetensors"
        save_snapshot(file, tokens, cache, identity={"model_id": name})
        plan["cases"][name] = {"tokens": tokens, "next": nxt, "file": str(file),
                               "classes": [type(c).__name__ for c in cache]}
    (root / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "mlx_lm_sessions.py"), str(root / "plan.json"),
                    str(root / "out.npz")], check=True, env=env, timeout=900)
    with np.load(root / "out.npz") as out:
        results = {k: out[k] for k in out.files}
    return plan, results


def uninterrupted(name: str, inputs: list[int], steps: int, p: int | None = None):
    """The same session run again in this process, cut to ``p`` by mlx-lm's own trim, then continued."""
    case = CASES[name]
    tokens, cache, _ = session(case)
    if p is not None and p < len(tokens):
        assert can_trim_prompt_cache(cache)
        assert trim_prompt_cache(cache, len(tokens) - p) == len(tokens) - p
    return run(case, cache, inputs, steps)


def assert_bit_identical(results, key: str, reference) -> None:
    tokens, logits = reference
    assert results[f"{key}/tokens"].tolist() == tokens
    expected = np.stack([np.array(x) for x in logits])
    got = results[f"{key}/logits"]
    assert got.dtype == expected.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), f"{key}: logits differ"


@pytest.mark.parametrize("name", NAMES)
def test_restore_gives_back_mlx_lm_classes_that_continue_bit_identically(restored, name):
    plan, results = restored
    info = plan["cases"][name]
    assert json.loads(str(results["classes"]))[name] == info["classes"]
    reference = uninterrupted(name, [info["next"]], 3)
    assert_bit_identical(results, f"{name}/restore", reference)
    assert_bit_identical(results, f"{name}/file", reference)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["extend", "cut", "diverge"])
def test_restore_prefix_follows_the_prefix_rule_and_continues_bit_identically(restored, name, kind):
    plan, results = restored
    info, case = plan["cases"][name], CASES[name]
    prompt = prompts(info["tokens"], info["next"])[kind]
    p = expected_length(case, info["tokens"], prompt)
    got = int(results[f"{name}/{kind}/length"])
    if p is None:
        assert got == -1, f"{name}/{kind}: restore_prefix must be None (not trimmable), got {got} positions"
        assert kind != "extend"
        return
    assert got == p
    assert_bit_identical(results, f"{name}/{kind}", uninterrupted(name, prompt[p:], 2, p))


def test_the_cases_cover_every_prefix_outcome():
    """Both sides of the rule are exercised: some cases cut, some must refuse a cut."""
    assert {c.trimmable for c in CASES.values()} == {True, False}
    assert {"mamba", "mamba2", "qwen3_next", "gemma3_text", "qwen3_wrapped"} == {
        n for n, c in CASES.items() if not c.trimmable}
