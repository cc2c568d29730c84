"""A seeded request's sampler inside mlx-lm's batch: it draws from a random key of its own.

Why: mlx-lm's samplers draw from mlx's *global* random state (``mx.random.state``), which every sampled row of a
batch advances. A seeded request sharing it would see draws that depend on whoever else is in the batch, so neither
its answer nor its resumption would be determined by the request. This wrapper gives the row its own key: at graph
construction time (when ``GenerationBatch._step`` calls the row's sampler) it makes the row's key mlx's random state,
calls mlx-lm's sampler, takes the advanced key back and makes the shared key the state again. MLX exposes the state
read-only (``mx.random.state[0]``; it cannot be assigned), and ``mx.random.seed(s)`` sets it to the key
``[s >> 32, s & 0xffffffff]``, so a key is put back by seeding with its two words: exactly the same key (the
shared one included), at the cost of reading the row's key, a value the previous step computed with its token.
mlx-lm's ``categorical_sampling`` is compiled with ``inputs=mx.random.state, outputs=mx.random.state``: it reads
and advances exactly that state, so the row's draws are the ones ``mx.random.seed(seed)`` followed by the same
samplings gives, whatever the batch holds. With distinct samplers per row, ``GenerationBatch`` samples row by row
(each row's logprobs alone), which keeps one row's draw independent of the others.

The key is two uint32 words; :meth:`state` gives it as 8 bytes (``resumable.random_state``'s layout, the
``sampler_state`` of a generation checkpoint) and :meth:`from_state` rebuilds the sampler from them on resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np


class SeededRowSampler:
    """``sampler`` (mlx-lm's, for one request) drawing from ``key`` (an ``mx.random.key``) instead of the global
    state."""

    def __init__(self, sampler: Callable[[mx.array], mx.array], key: mx.array):
        self.sampler = sampler
        self.key = key

    @classmethod
    def seeded(cls, sampler: Callable[[mx.array], mx.array], seed: int) -> SeededRowSampler:
        """The row of a request with ``seed``: the key ``mx.random.seed(seed)`` would set."""
        return cls(sampler, mx.random.key(int(seed)))

    @classmethod
    def from_state(cls, sampler: Callable[[mx.array], mx.array], state: bytes) -> SeededRowSampler:
        """The row resumed from a checkpoint's ``sampler_state`` (:meth:`state`)."""
        hi, lo = (int(x) for x in np.frombuffer(bytes(state), dtype="<u4"))
        return cls(sampler, mx.random.key((hi << 32) | lo))

    def __call__(self, logprobs: mx.array) -> mx.array:
        shared = mx.random.state[0]
        mx.random.seed(key_seed(self.key))
        try:
            out = self.sampler(logprobs)
            self.key = mx.random.state[0]
        finally:
            mx.random.seed(key_seed(shared))
        return out

    def state(self) -> bytes:
        """The row's key now (after the draws made so far) as 8 bytes."""
        return key_bytes(self.key)


def key_seed(key: mx.array) -> int:
    """The seed whose ``mx.random.seed`` sets mlx's random state to ``key``."""
    hi, lo = (int(x) for x in key.tolist())
    return (hi << 32) | lo


def key_bytes(key: Any) -> bytes:
    """A random key (two uint32 words) as the 8 bytes of a checkpoint's ``sampler_state``."""
    return np.asarray(key, dtype=np.uint32).astype("<u4").tobytes()


def row_sampler(sampler: Any, seed: int | None) -> Any:
    """The sampler a request's row gets: its own key when it has a seed, mlx-lm's sampler unchanged otherwise."""
    return sampler if seed is None else SeededRowSampler.seeded(sampler, seed)


__all__ = ["SeededRowSampler", "key_bytes", "row_sampler"]
