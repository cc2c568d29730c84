"""A seeded row of mlx-lm's batch samples from its own key (``row_sampler.py``): its draws are exactly those of
``mx.random.seed(seed)`` followed by the same samplings, whoever else draws from mlx's global random state in
between, the global state comes back unchanged, and a sampler rebuilt from a saved state continues the sequence (a
resume). In process: real MLX arrays and mlx-lm's own sampler."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

from kvshelf.mlx_lm.serve.row_sampler import SeededRowSampler

N = 40


def logprobs() -> mx.array:
    logits = mx.array(np.random.default_rng(0).normal(size=(1, 64)).astype(np.float32))
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_a_seeded_row_draws_as_a_seeded_run_alone_and_resumes_from_its_saved_state():
    lp, sampler = logprobs(), make_sampler(0.8)
    mx.random.seed(1234)
    alone = [sampler(lp).item() for _ in range(N)]

    mx.random.seed(99)
    row, other = SeededRowSampler.seeded(sampler, 1234), SeededRowSampler.seeded(sampler, 7)
    got, saved = [], None
    for i in range(N):
        mx.random.uniform(shape=(3,))  # a row without a seed draws from the global state
        before = np.asarray(mx.random.state[0]).tolist()
        got.append(row(lp).item())
        other(lp)
        assert np.asarray(mx.random.state[0]).tolist() == before  # the global state is left as it was
        if i == N // 2:
            saved = (len(got), row.state())
    assert got == alone

    n, state = saved
    resumed = SeededRowSampler.from_state(sampler, state)
    assert [resumed(lp).item() for _ in range(N - n)] == alone[n:]
