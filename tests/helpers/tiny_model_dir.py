"""A tiny model *directory* (config.json, model.safetensors, tokenizer files with a chat template), built offline.

Why: ``kvshelf serve`` and plain ``mlx_lm.server`` load a model from a directory exactly as users do (mlx-lm's
``load``: config -> model class, safetensors weights, a transformers tokenizer), so the serving tests need a real one
that downloads nothing. Weights are seeded float32 (every process that builds the same ``(arch, seed)`` writes the
same bytes), the tokenizer is a ``tokenizers`` WordLevel over a small fixed vocabulary split on whitespace, so a
reply the model generates re-tokenizes to the same ids in the next turn.

Usage::

    make_model_dir(tmp_path / "tiny", arch="llama", seed=0)
    # python -m mlx_lm.server --model tmp_path/tiny   (HF_HUB_OFFLINE=1)
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = [
    "the", "a", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with",
    "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what", "all",
    "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do", "how", "their",
    "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her", "would",
    "make", "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number", "no", "way",
    "could", "people", "my", "than", "first", "water", "been", "call", "who", "oil", "its", "now", "find", "long",
    "down", "day", "did", "get", "come", "made", "may", "part", "cache", "store", "model", "token", "prefix", "disk",
    "memory", "server", "reply", "system", "helpful", "assistant", "answer", "question", "short", "polite", "always",
    "never", "shelf", "key", "value", "layer", "tiny", "seed", "prompt", "restart", "shared", "hello", "world",
]
VOCAB = SPECIAL + WORDS
EOS = "<|end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
# A thinking model's template (Qwen3's rule): an assistant message after the last user message keeps its reasoning
# (an agent's tool-calling steps), an earlier one comes back without it once the next user message arrives. The
# "reasoning" here is an answer's first word (tiny models write no think tags). So the turn after a tool step
# re-renders that step shorter and leaves the cached sequence inside the previous prompt, before any segment end
# mlx-lm's server inserted a cache at.
THINKING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last %}{{ m['content'].split(' ')[1:] | join(' ') }}"
    "{% else %}{{ m['content'] }}{% endif %} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
# A tool-calling template (an agent's conversation): the tools' names before the conversation, an assistant's tool
# calls and the tool results rendered. No tool-call markers the tiny model could emit, so mlx-lm's tool parser stays
# off and replies are plain text.
TOOL_TEMPLATE = (
    "{% if tools %}<|system|> {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|end|> {% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %} call {{ c['function']['name'] }}"
    "{% for k, v in c['function']['arguments'].items() %} {{ v }}{% endfor %}{% endfor %}{% endif %} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

# Small, fast configs; "bench" is larger so that a long prompt's prefill takes about a second or more on a 2-core CPU.
_LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=2,  # noqa: C408
              num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
              max_position_embeddings=32768)
_LLAMA_BENCH = dict(_LLAMA, hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64)
# Cheap to run, heavy to store (16 KiB of cache per token): long write-behinds for the crash tests.
_LLAMA_KV = dict(_LLAMA, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=64)
# Long-context restarts (issue 32): KV as large per token as a real 8B model's per layer group (8 layers × 8 KV heads
# × 128 dims, bfloat16 weights so the cache is bfloat16: 32 KiB per token, 2 GiB at 64K), cheap layers otherwise.
_LLAMA_LONG_KV = dict(_LLAMA, hidden_size=256, num_hidden_layers=8, intermediate_size=256, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)
_QWEN3_NEXT = dict(  # noqa: C408 - a hybrid: full-attention layers (KVCache) and GatedDeltaNet layers (ArraysCache)
    model_type="qwen3_next", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=2,
    linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
    shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6,
    num_key_value_heads=1, rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=32768,
    head_dim=32, full_attention_interval=2, tie_word_embeddings=False,
)
_MAMBA2 = dict(  # noqa: C408 - pure state-space layers (ArraysCache only)
    model_type="mamba2", num_heads=4, head_dim=16, hidden_size=32, intermediate_size=64, state_size=8,
    num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True,
    tie_word_embeddings=True, time_step_limit=[0.0, 1e9], time_step_rank=4, chunk_size=64,
)
# Llama 3.1's scaled RoPE: its frequencies are an array built in the constructor, outside the parameters
_LLAMA_ROPE_SCALED = dict(_LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
CONFIGS = {"llama": _LLAMA, "llama-rope-scaled": _LLAMA_ROPE_SCALED, "llama-bench": _LLAMA_BENCH, "llama-kv": _LLAMA_KV, "llama-long-kv": _LLAMA_LONG_KV,
           "qwen3_next": _QWEN3_NEXT, "mamba2": _MAMBA2}
_KEEP_AROUND = ("norm", "A_log", "D", "dt_bias", "bias")
BFLOAT16 = {"llama-long-kv"}  # written in bfloat16 (mlx-lm then computes, and caches, in bfloat16)


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    return tok.to_str()


def _seeded_weights(model, seed: int) -> dict:
    """Every parameter re-drawn from a key of (seed, parameter path): the same bytes in every process."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = {}
    for path, value in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        key = mx.random.key((seed * 1_000_003) ^ zlib.crc32(path.encode()))
        noise = mx.random.normal(value.shape, dtype=mx.float32, key=key)
        if any(tag in part for part in path.rsplit(".", 2) for tag in _KEEP_AROUND) or value.ndim < 2:
            out[path] = value.astype(mx.float32) + 0.05 * noise
        else:
            out[path] = 1.5 * noise / math.sqrt(value.shape[-1])
    return out


def write_tokenizer(path: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """tokenizer.json, tokenizer_config.json (chat template inside) and special_tokens_map.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": EOS, "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": 1 << 20, "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": EOS, "unk_token": "<unk>", "pad_token": "<pad>"}))


def make_model_dir(path: str | Path, arch: str = "llama", seed: int = 0, chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write a loadable tiny ``arch`` model (one of ``CONFIGS``) with weights seeded by ``seed`` into ``path``."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIGS[arch], vocab_size=len(VOCAB), eos_token_id=VOCAB.index(EOS), bos_token_id=VOCAB.index("<s>"))
    model_class, args_class = _get_classes(config)
    # Seeded before construction: some constructors draw the values ``_KEEP_AROUND`` keeps (qwen3_next's ``A_log``
    # is ``log(uniform(0, 16))``), so without it each process built a different model from the same seed.
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = _seeded_weights(model, seed)
    if arch in BFLOAT16:
        weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    mx.eval(list(weights.values()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    write_tokenizer(path, chat_template)
    return path


def words(n: int, salt: int = 0) -> str:
    """``n`` vocabulary words in a fixed pseudo-random order (a long system prompt, a user turn)."""
    return " ".join(WORDS[(i * 7 + salt * 13 + (i * i) % 11) % len(WORDS)] for i in range(n))


__all__ = ["CHAT_TEMPLATE", "CONFIGS", "EOS", "VOCAB", "WORDS", "make_model_dir", "words", "write_tokenizer"]
