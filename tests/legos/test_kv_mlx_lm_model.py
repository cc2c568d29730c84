"""mlx-lm model code runs unchanged on our key/value legos.

With mlx-lm installed, a tiny randomly initialised Llama from ``mlx_lm.models.llama`` runs a prompt and decode
steps (and mlx-lm's ``trim_prompt_cache``) on our caches and on mlx-lm's own: the logits are bit-identical, also
across a snapshot -> load in the middle of the conversation. Without mlx-lm the same conversation runs through a
local attention stack written in mlx-lm's calling convention, against a concatenating reference (never skipped).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from kv_cases import same

from kvshelf.codecs import default_provider
from kvshelf.latent_legos.kv import KVCache, QuantizedKVCache, RotatingKVCache, TurboQuantKVCache

try:
    from mlx_lm.models import cache as lm_cache
    from mlx_lm.models import llama

    HAVE_MLX_LM = True
except ImportError:
    HAVE_MLX_LM = False

LAYERS = 2


class LocalModel(nn.Module):
    """Two attention layers in mlx-lm's calling convention (used only when mlx-lm is absent)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 128)
        self.qkv = [nn.Linear(128, 3 * 128, bias=False) for _ in range(LAYERS)]
        self.head = nn.Linear(128, 256, bias=False)

    def __call__(self, tokens: mx.array, cache) -> mx.array:
        h = self.embed(tokens)
        b, n, _ = h.shape
        for layer, c in zip(self.qkv, cache):
            q, k, v = (x.reshape(b, n, 2, 64).transpose(0, 2, 1, 3) for x in mx.split(layer(h), 3, axis=-1))
            mask = c.make_mask(n, return_array=False, window_size=None)
            keys, values = c.update_and_fetch(k, v)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
            h = h + out.transpose(0, 2, 1, 3).reshape(b, n, 128)
        return self.head(h)


class ConcatCache:
    def __init__(self) -> None:
        self.keys = self.values = None
        self.offset = 0

    def make_mask(self, n, return_array=False, window_size=None):
        return None if n == 1 else "causal"

    def update_and_fetch(self, k, v):
        if self.keys is not None:
            k = mx.concatenate([self.keys[:, :, : self.offset], k], axis=2)
            v = mx.concatenate([self.values[:, :, : self.offset], v], axis=2)
        self.keys, self.values, self.offset = k, v, k.shape[2]
        return k, v

    def is_trimmable(self):
        return True

    def trim(self, n):
        self.offset -= n
        return n


def model():
    mx.random.seed(11)
    if HAVE_MLX_LM:
        args = llama.ModelArgs(
            model_type="llama", hidden_size=128, num_hidden_layers=LAYERS, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, vocab_size=256,
        )
        m = llama.Model(args)
    else:
        m = LocalModel()
    m.set_dtype(mx.bfloat16)
    mx.eval(m.parameters())
    return m


def reference_caches(kind: str):
    if not HAVE_MLX_LM:
        return [ConcatCache() for _ in range(LAYERS)]
    make = {"kv": lm_cache.KVCache, "qkv": lambda: lm_cache.QuantizedKVCache(64, 8),
            "ring": lambda: lm_cache.RotatingKVCache(8)}[kind]
    return [make() for _ in range(LAYERS)]


OURS = {"kv": KVCache, "qkv": lambda: QuantizedKVCache(64, 8), "ring": lambda: RotatingKVCache(8)}
PROMPT = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])


def trim_all(caches, n):
    if HAVE_MLX_LM:
        return lm_cache.trim_prompt_cache(caches, n)
    return [c.trim(n) for c in caches][0]


def converse(m, caches, restore_at: int | None = None):
    """Prompt, decode steps, a trim and more steps; optionally snapshot+load the caches after step ``restore_at``."""
    logits = [m(PROMPT, cache=caches)]
    for i, token in enumerate([7, 1, 200, 9]):
        if restore_at == i:
            caches = [default_provider.load(*default_provider.snapshot(c)) for c in caches]
        logits.append(m(mx.array([[token]]), cache=caches))
    if all(c.is_trimmable() for c in caches):
        assert trim_all(caches, 2) == 2
        logits.append(m(mx.array([[5, 6]]), cache=caches))
    return logits


@pytest.mark.parametrize("kind", ["kv", "qkv", "ring"] if HAVE_MLX_LM else ["kv"])
def test_model_logits_match_the_reference_caches_bit_for_bit(kind):
    m = model()
    ours = converse(m, [OURS[kind]() for _ in range(LAYERS)])
    theirs = converse(m, reference_caches(kind))
    assert len(ours) == len(theirs) >= 5 and same(ours, theirs)


@pytest.mark.parametrize("kind", ["kv", "qkv", "ring"] if HAVE_MLX_LM else ["kv", "ring"])
def test_a_restored_conversation_continues_bit_identically(kind):
    m = model()
    straight = converse(m, [OURS[kind]() for _ in range(LAYERS)])
    resumed = converse(m, [OURS[kind]() for _ in range(LAYERS)], restore_at=2)
    assert same(straight, resumed)


def test_turboquant_runs_in_model_code_close_to_plain():
    m = model()
    plain = converse(m, [KVCache() for _ in range(LAYERS)])
    turbo = converse(m, [TurboQuantKVCache(8, 8) for _ in range(LAYERS)], restore_at=1)
    for a, b in zip(plain, turbo):
        diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        assert a.shape == b.shape and diff < 0.5
