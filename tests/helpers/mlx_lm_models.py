"""Tiny mlx-lm models built from mlx-lm's own model classes, with seeded float32 weights and nothing downloaded.

Why: the mlx-lm integration must be tested on the code paths users actually run (mlx-lm's attention, its RoPE
offsets, its cache classes), and two processes (a saver and a restorer) must build the very same weights so that
"bit-identical to an uninterrupted run" is a meaningful comparison. Every parameter is re-drawn from a key derived
from the model name and the parameter's path, so the weights do not depend on global random state or on the order
in which mlx-lm's constructors happen to draw numbers. Weights are float32 so exact comparisons are not blurred by
bfloat16 rounding.

Usage::

    model = build("deepseek_v3")
    tokens, logits = greedy(model, PROMPT, make_prompt_cache(model), steps=4)
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models import (
    deepseek_v3,
    gemma3_text,
    glm4_moe_lite,
    glm_moe_dsa,
    llama,
    mamba,
    mamba2,
    qwen3,
    qwen3_next,
)
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

VOCAB = 96
SEED = 20261201

# MLA widths (kv_lora_rank 64, qk_rope_head_dim 32) are multiples of 32 so kvshelf's affine and TurboQuant latent
# encodings (32-wide groups) apply, as they do at real sizes (512 / 64).
# A prompt longer than glm_moe_dsa's index_topk (so the sparse indexer path runs) and than gemma's window.
PROMPT = [5, 17, 42, 8, 77, 3, 61, 29, 90, 11]

_MLA_COMMON = dict(  # noqa: C408 - keyword form keeps the ModelArgs names greppable
    vocab_size=VOCAB, hidden_size=48, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
    kv_lora_rank=64, q_lora_rank=24, qk_rope_head_dim=32, v_head_dim=16, qk_nope_head_dim=16, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
    first_k_dense_replace=1, max_position_embeddings=512, rms_norm_eps=1e-6, attention_bias=False,
)


def _llama():
    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5, vocab_size=VOCAB, tie_word_embeddings=False,
    ))


def _llama64():
    """llama with 64-wide heads: TurboQuant key/value legos need head dims of 64..512."""
    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=96, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5, vocab_size=VOCAB, tie_word_embeddings=False,
    ))


def _qwen3():
    return qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=2,
        rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=1, max_position_embeddings=512, head_dim=32,
        tie_word_embeddings=True, rope_theta=10000.0,
    ))


def _deepseek_v3():
    return deepseek_v3.Model(deepseek_v3.ModelArgs(model_type="deepseek_v3", rope_theta=10000.0, **_MLA_COMMON))


def _glm_moe_dsa():
    return glm_moe_dsa.Model(glm_moe_dsa.ModelArgs(
        model_type="glm_moe_dsa", index_head_dim=32, index_n_heads=2, index_topk=4,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, **_MLA_COMMON,
    ))


def _glm4_moe_lite():
    return glm4_moe_lite.Model(glm4_moe_lite.ModelArgs(model_type="glm4_moe_lite", rope_theta=10000.0, **_MLA_COMMON))


def _gemma3_text():
    return gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=2,
        head_dim=32, rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=1, query_pre_attn_scalar=32,
        sliding_window=4, sliding_window_pattern=2, max_position_embeddings=512,
    ))


def _qwen3_next():
    return qwen3_next.Model(qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=2,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6,
        vocab_size=VOCAB, num_key_value_heads=1, rope_theta=10000.0, partial_rotary_factor=0.5,
        max_position_embeddings=512, head_dim=32, full_attention_interval=2,
    ))


def _mamba():
    return mamba.Model(mamba.ModelArgs(
        model_type="mamba", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, state_size=8,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
    ))


def _mamba2():
    return mamba2.Model(mamba2.ModelArgs(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        state_size=8, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=True, time_step_limit=(0.0, float("inf")), time_step_rank=4,
    ))


BUILDERS: dict[str, Callable] = {
    "llama": _llama, "llama64": _llama64, "qwen3": _qwen3, "deepseek_v3": _deepseek_v3, "glm_moe_dsa": _glm_moe_dsa,
    "glm4_moe_lite": _glm4_moe_lite, "gemma3_text": _gemma3_text, "qwen3_next": _qwen3_next, "mamba": _mamba,
    "mamba2": _mamba2,
}
NAMES = tuple(BUILDERS)
MLA_NAMES = ("deepseek_v3", "glm_moe_dsa")  # the MLA models; glm4_moe_lite is a third (NAMES has it)

# Parameters whose constructor value is a meaningful constant the model relies on (norm scales start at one,
# state-space decay parameters have a sign convention); they get small seeded noise around it instead of a redraw.
_KEEP_AROUND = ("norm", "A_log", "D", "dt_bias", "e_score_correction_bias", "bias")


def _init(name: str, model) -> None:
    """Re-draw every parameter from a key of (SEED, name, parameter path): identical in every process."""
    fresh = []
    for path, value in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        key = mx.random.key(SEED ^ zlib.crc32(f"{name}/{path}".encode()))
        noise = mx.random.normal(value.shape, dtype=mx.float32, key=key)
        leaf = path.rsplit(".", 2)
        if any(tag in part for part in leaf for tag in _KEEP_AROUND) or value.ndim < 2:
            new = value.astype(mx.float32) + 0.05 * noise
        else:
            new = 1.5 * noise / math.sqrt(value.shape[-1])
        fresh.append((path, new.astype(mx.float32)))
    model.update(tree_unflatten(fresh))


def build(name: str):
    """A tiny float32 ``name`` model (one of ``NAMES``) with seeded weights, evaluated and ready."""
    if name not in BUILDERS:
        raise KeyError(f"unknown tiny model {name!r}; one of {NAMES}")
    mx.random.seed(SEED)
    model = BUILDERS[name]()
    model.set_dtype(mx.float32)
    _init(name, model)
    mx.eval(model.parameters())
    return model


def quantized_cache(model, bits: int = 8, group_size: int = 32) -> list:
    """mlx-lm's ``QuantizedKVCache`` for every layer (an attention-only model such as llama or qwen3)."""
    return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]


def forward(model, tokens: Sequence[int] | mx.array, cache) -> mx.array:
    """Last-position float32 logits of one forward over ``tokens`` (a list is one row; an array is (batch, n))."""
    inputs = tokens if isinstance(tokens, mx.array) else mx.array([list(tokens)])
    logits = model(inputs, cache=cache)[:, -1, :].astype(mx.float32)
    mx.eval(logits)
    return logits


def greedy(model, prompt: Sequence[int], cache, steps: int = 4) -> tuple[list[int], list[mx.array]]:
    """Prefill ``prompt`` in one forward, then ``steps`` greedy decode steps on ``cache``.

    Returns the ``steps + 1`` greedy tokens (the one after the prompt first) and each step's (1, vocab) logits.
    """
    logits = [forward(model, prompt, cache)]
    tokens = [int(mx.argmax(logits[-1], axis=-1).item())]
    for _ in range(steps):
        logits.append(forward(model, [tokens[-1]], cache))
        tokens.append(int(mx.argmax(logits[-1], axis=-1).item()))
    return tokens, logits


def continue_greedy(model, first: int, cache, steps: int) -> tuple[list[int], list[mx.array]]:
    """``steps`` decode steps from token ``first`` on an already-filled ``cache`` (a restored session)."""
    tokens, logits = [first], []
    for _ in range(steps):
        logits.append(forward(model, [tokens[-1]], cache))
        tokens.append(int(mx.argmax(logits[-1], axis=-1).item()))
    return tokens[1:], logits


def quantized_kv_run(model, prompt: Sequence[int], steps: int = 4, kv_bits: int = 8, kv_group_size: int = 32,
                     quantized_kv_start: int = 0) -> tuple[list[int], list[mx.array], list]:
    """Greedy tokens, logprobs and the cache of mlx-lm's ``generate_step`` run with ``kv_bits`` (QuantizedKVCache).

    mlx-lm computes one step ahead, so the cache then holds the prompt and all ``steps + 1`` yielded tokens.
    """
    cache = make_prompt_cache(model)
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(list(prompt)), model, max_tokens=steps + 1, prompt_cache=cache,
                                   kv_bits=kv_bits, kv_group_size=kv_group_size,
                                   quantized_kv_start=quantized_kv_start):
        tokens.append(int(token))
        logprobs.append(lp)
    return tokens, logprobs, cache


def same(a: mx.array, b: mx.array) -> bool:
    """Bit-identical arrays (shape, dtype and every value)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def same_run(a: tuple[list[int], list[mx.array]], b: tuple[list[int], list[mx.array]]) -> bool:
    """Two greedy runs agree exactly: the same tokens and bit-identical logits at every step."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(same(x, y) for x, y in zip(a[1], b[1]))
