"""Helpers shared by the latent-adapter tests: the provider that knows the adapters' codecs, sessions saved from
tiny mlx-lm models, batched greedy decode and mlx-lm's BatchGenerator runs."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm_models import PROMPT, continue_greedy, forward, greedy

from kvshelf.codecs import default_provider
from kvshelf.codecs.provider import DEFAULT_PROVIDER_ID
from kvshelf.mlx_lm.codecs.latent import LATENT_ADAPTER_CODECS

STEPS = 4
PROMPTS = [PROMPT, PROMPT[:6], PROMPT[:3] + [9]]  # unequal lengths: 10, 6, 4


def provider():
    """The default provider with the latent adapters' codecs (kvshelf.mlx_lm's plugin registers them itself once
    it is present; until then they join here under the same provider id)."""
    if "mlx-lm.latent" in default_provider.kinds:
        return default_provider
    return default_provider.extended(DEFAULT_PROVIDER_ID, LATENT_ADAPTER_CODECS)


def log_probs(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sessions(store, model, make, prompts):
    """Each prompt prefilled on ``make(model)`` and saved as ``s<i>``: (first tokens, [(caches, serial run)])."""
    firsts, serial = [], []
    for i, prompt in enumerate(prompts):
        caches = make(model)
        tokens, _ = greedy(model, prompt, caches, steps=0)
        store.save(f"s{i}", prompt, caches)
        firsts.append(tokens[0])
        serial.append((caches, continue_greedy(model, tokens[0], caches, STEPS)))
    return firsts, serial


def batched_decode(model, caches, firsts):
    """Greedy decode of every row at once: per row, the (1, vocab) logits of each step."""
    inputs, logits = list(firsts), [[] for _ in firsts]
    for _ in range(STEPS):
        step = forward(model, mx.array([[t] for t in inputs]), caches)
        inputs = mx.argmax(step, axis=-1).tolist()
        for b in range(len(firsts)):
            logits[b].append(step[b : b + 1])
    return logits


def generated(model, prompts, caches):
    """mlx-lm's BatchGenerator over ``prompts`` with ``caches`` per row: per row, (tokens, logprobs)."""
    gen = BatchGenerator(model, max_tokens=STEPS)
    uids = gen.insert(prompts, caches=caches)
    got = {u: ([], []) for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid][0].append(r.token)
            got[r.uid][1].append(r.logprobs)
    gen.close()
    return [got[u] for u in uids]
