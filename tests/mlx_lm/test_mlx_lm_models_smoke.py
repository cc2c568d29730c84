"""The tiny mlx-lm models the integration tests rely on really run, and two processes build the same weights.

If a builder silently ran without its cache, or weights depended on process state, every "bit-identical after a
restore in a fresh process" test built on them would prove nothing; these checks guard that ground.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from mlx_lm_models import (
    NAMES,
    PROMPT,
    build,
    greedy,
    quantized_cache,
    quantized_kv_run,
    same_run,
)

HERE = Path(__file__).parent


def digest(model) -> str:
    h = hashlib.sha256()
    for path, value in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(path.encode())
        h.update(np.array(value).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", NAMES)
def test_builder_runs_on_its_prompt_cache_and_uses_it(name):
    model = build(name)
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))
    cached = greedy(model, PROMPT, make_prompt_cache(model), steps=3)
    assert len(cached[0]) == 4 and all(0 <= t < 96 for t in cached[0])
    # Without history, the decode steps would see only one token: the cache must change the answer.
    lone = model(mx.array([[cached[0][0]]]), cache=make_prompt_cache(model))[:, -1, :]
    assert not bool(mx.array_equal(lone.astype(mx.float32), cached[1][1]).item())
    # A second build and run in the same process is identical.
    assert same_run(cached, greedy(build(name), PROMPT, make_prompt_cache(model), steps=3))


def test_weights_are_identical_in_a_fresh_process():
    code = "import sys; from test_mlx_lm_models_smoke import digest; from mlx_lm_models import NAMES, build\n" \
           "print(' '.join(digest(build(n)) for n in NAMES))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "helpers"), str(HERE.parents[1]),
                                                  os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=600)
    assert out.stdout.split() == [digest(build(n)) for n in NAMES]


def test_quantized_kv_runs_through_mlx_lm_caches():
    model = build("llama")
    tokens, _, cache = quantized_kv_run(model, PROMPT, steps=3, kv_bits=8)
    assert len(tokens) == 4 and all(isinstance(c, QuantizedKVCache) for c in cache)
    assert cache[0].offset == len(PROMPT) + 4
    direct = greedy(model, PROMPT, quantized_cache(model, bits=8), steps=3)
    assert direct[0] == tokens
