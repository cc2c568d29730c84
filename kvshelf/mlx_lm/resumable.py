"""Decoding that can stop anywhere and continue exactly: mlx-lm's ``generate_step`` with generation checkpoints.

Why a port of the loop and not a wrapper: ``generate_step`` samples one token ahead (the token it yields was sampled
one step earlier), and at a checkpoint the state to keep is exactly that look-ahead: the caches cover the prompt and
every token emitted so far, the *pending* token was sampled from them and not yet emitted, and the random state is
the one right after that sampling. The generator hides all three, so :func:`steps_with_generation_checkpoints` repeats
its loop (prefill in ``prefill_step_size`` chunks, one model call per token, ``async_eval`` of the next step, the
logits processors over the token history, ``maybe_quantize_kv_cache``) and adds the generation checkpoint hook and
the resume start.

Exactness: a resumed run restores the caches (bit-exact), the logits processors' history (the whole token list) and
the random state (``mx.random.seed`` of the saved 64-bit key), then computes the very step the uninterrupted run
computed next, so greedy decoding, and sampling with mlx-lm's samplers from a saved state, emit the same tokens.

``resumable_generate`` is ``stream_generate`` on top of it, for library users (see docs/RESUMING.md).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationResponse, maybe_quantize_kv_cache, wired_limit
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import InvalidCacheState
from ..store.generations import GenerationCheckpoint, continuation_key
from .generation_checkpoint_writer import GenerationCheckpointWriter

OnGenerationCheckpoint = Callable[[list[int], list[Any], int, bytes], None]


def random_state() -> bytes:
    """mlx's global random key (two uint32 words) as 8 bytes."""
    return np.asarray(mx.random.state[0], dtype=np.uint32).astype("<u4").tobytes()


def set_random_state(state: bytes) -> None:
    """Make mlx's global random key the one :func:`random_state` returned (``mx.random.seed(s)`` sets the key to
    ``[s >> 32, s & 0xffffffff]``)."""
    hi, lo = (int(x) for x in np.frombuffer(bytes(state), dtype="<u4"))
    mx.random.seed((hi << 32) | lo)


def steps_with_generation_checkpoints(model: Any, prompt_tokens: Sequence[int], *, prompt_cache: list[Any],
                                      cached: int = 0, resume: GenerationCheckpoint | None = None,
                                      max_tokens: int = 256, sampler: Callable | None = None,
                                      logits_processors: list[Callable] | None = None, every: int = 0,
                                      on_generation_checkpoint: OnGenerationCheckpoint | None = None,
                                      stream: Any = None, prefill_step_size: int = 2048, kv_bits: int | None = None,
                                      kv_group_size: int = 64, quantized_kv_start: int = 0,
                                      prompt_progress_callback: Callable[[int, int], None] | None = None,
                                      ) -> Iterator[tuple[int, Any]]:
    """``(token, logprobs)`` as ``generate_step`` yields them, for the prompt ``prompt_tokens`` whose first ``cached``
    tokens are already in ``prompt_cache``. With ``resume`` (a generation checkpoint of this prompt), ``prompt_cache``
    is its caches and decoding continues from its pending token (which comes first, with ``logprobs`` None); the
    tokens it had generated are not yielded again. Every ``every`` emitted tokens (counted from the prompt, so a
    resumed run checkpoints where the first run would have) ``on_generation_checkpoint(tokens, caches, pending,
    random_state)`` is called after the consumer took the token and asked for the next."""
    stream = stream if stream is not None else mx.default_stream(mx.default_device())
    sampler = sampler or (lambda x: mx.argmax(x, axis=-1))
    progress = prompt_progress_callback or (lambda *_: None)
    quantize = functools.partial(maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start,
                                 kv_group_size=kv_group_size, kv_bits=kv_bits)
    prompt = [int(t) for t in prompt_tokens]
    history = None

    def _step(input_tokens: mx.array):
        nonlocal history
        with mx.stream(stream):
            logits = model(input_tokens[None], cache=prompt_cache)[:, -1, :]
            if logits_processors:
                history = mx.concat([history, input_tokens]) if history is not None else input_tokens
                for processor in logits_processors:
                    logits = processor(history, logits)
            quantize(prompt_cache)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)

    with mx.stream(stream):
        if resume is not None:
            emitted = list(resume.generated)
            if logits_processors:
                history = mx.array(resume.tokens)
            if resume.sampler_state is not None:
                set_random_state(resume.sampler_state)
            y, logprobs = mx.array([resume.pending_token]), None
            total = 0
        else:
            emitted = []
            rest = prompt[cached:]
            if not rest:
                raise InvalidCacheState("steps_with_generation_checkpoints needs at least one prompt token not in "
                                        "the cache")
            if logits_processors and len(prompt) > 1:
                history = mx.array(prompt[:-1])
            total = len(rest)
            done = 0
            progress(done, total)
            while total - done > 1:
                n = min(prefill_step_size, total - done - 1)
                model(mx.array(rest[done:done + n])[None], cache=prompt_cache)
                quantize(prompt_cache)
                mx.eval([c.state for c in prompt_cache])
                done += n
                progress(done, total)
                mx.clear_cache()
            y, logprobs = _step(mx.array(rest[-1:]))
            mx.async_eval(y, logprobs)

        start = n = len(emitted)
        while True:
            if n != max_tokens:
                next_y, next_logprobs = _step(y)
                mx.async_eval(next_y, next_logprobs)
            if n == start:
                mx.eval(y)
                if resume is None:
                    progress(total, total)
            if n == max_tokens:
                break
            token = y.item()
            yield token, logprobs
            emitted.append(token)
            if n % 256 == 0:
                mx.clear_cache()
            n += 1
            if every and on_generation_checkpoint is not None and n % every == 0 and n != max_tokens:
                on_generation_checkpoint(prompt + emitted, prompt_cache, next_y.item(), random_state())
            y, logprobs = next_y, next_logprobs


def default_key(store: Any, prompt: Sequence[int], max_tokens: int, generate_kwargs: dict) -> str:
    """The continuation key ``resumable_generate`` uses when given none: the store's model identity, the prompt ids,
    ``max_tokens`` and every plain-valued keyword. Callables (``sampler``, ``logits_processors``) cannot be named
    by value, so with them a ``key`` must be given."""
    named = {k: v for k, v in generate_kwargs.items() if k not in _UNNAMED}
    opaque = sorted(k for k, v in named.items()
                    if callable(v) or (isinstance(v, (list, tuple)) and any(callable(x) for x in v)))
    if opaque:
        raise InvalidCacheState(f"resumable_generate needs key= when {', '.join(opaque)} is given: a callable cannot "
                                f"be part of a continuation key (name its settings, e.g. temperature and seed, in "
                                f"the key)")
    ident = store.identity
    return continuation_key({"model": [ident.model_id, ident.config_fingerprint, ident.tokenizer_hash],
                             "prompt": [int(t) for t in prompt], "max_tokens": int(max_tokens),
                             "settings": named})


_UNNAMED = ("prompt_progress_callback", "stream")  # how it runs, not what it computes
_REFUSED = ("draft_model", "prompt_cache", "input_embeddings", "max_kv_size", "num_draft_tokens")


def resumable_generate(model: Any, tokenizer: Any, prompt: str | Sequence[int] | mx.array, *, store: Any,
                       key: str | None = None, checkpoint_every: int = 256,
                       **generate_kwargs: Any) -> Iterator[GenerationResponse]:
    """``mlx_lm.stream_generate`` with generation checkpoints in ``store``: every ``checkpoint_every`` tokens a
    checkpoint is written behind; when a checkpoint of ``key`` exists for this prompt, its tokens are yielded at
    once (``logprobs`` None) and decoding continues from its pending token, so the output equals an uninterrupted
    run. A completed generation (EOS or ``max_tokens``) deletes the key's checkpoints; one abandoned by the caller
    keeps them. ``generate_kwargs``: ``max_tokens``, ``sampler``, ``logits_processors``, ``prefill_step_size``,
    ``kv_bits``, ``kv_group_size``, ``quantized_kv_start``, ``prompt_progress_callback``, ``stream``."""
    refused = [k for k in _REFUSED if generate_kwargs.get(k) is not None]
    if refused:
        raise InvalidCacheState(f"resumable_generate does not take {', '.join(refused)} (the prompt cache is its own; "
                                f"speculative decoding and rotating caches are not resumable)")
    for k in _REFUSED:
        generate_kwargs.pop(k, None)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=special)
    tokens = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    max_tokens = generate_kwargs.pop("max_tokens", 256)
    if max_tokens == 0:
        raise InvalidCacheState("max_tokens must be non-zero (use -1 for no limit)")
    if key is None:
        key = default_key(store, tokens, max_tokens, generate_kwargs)
    writer = GenerationCheckpointWriter(max_in_flight=1)
    found = store.find_generation_checkpoint(key, tokens)
    if found is not None:
        writer.counters["resumes"] += 1
        writer.counters["resumed_tokens"] += len(found.generated)
        writer.log.info("kvshelf resume from=%d of max_tokens=%d", len(found.generated), max_tokens)

    def on_generation_checkpoint(all_tokens, caches, pending, state):
        writer.submit(store, key, all_tokens, caches, prompt_length=len(tokens), pending_token=pending,
                      sampler_state=state)

    caches = found.caches if found is not None else make_prompt_cache(model)
    steps = steps_with_generation_checkpoints(model, tokens, prompt_cache=caches, resume=found, max_tokens=max_tokens,
                                              every=checkpoint_every, on_generation_checkpoint=on_generation_checkpoint,
                                              **generate_kwargs)
    detokenizer = tokenizer.detokenizer
    eos = tokenizer.eos_token_ids
    try:
        with wired_limit(model, [generate_kwargs.get("stream") or mx.default_stream(mx.default_device())]):
            tic = time.perf_counter()
            n = 0
            replay = found.generated if found is not None else []
            for n, token in enumerate(replay):
                detokenizer.add_token(token)
                yield GenerationResponse(text=detokenizer.last_segment, token=token, logprobs=None, from_draft=False,
                                         prompt_tokens=len(tokens), prompt_tps=0.0, generation_tokens=n + 1,
                                         generation_tps=0.0, peak_memory=mx.get_peak_memory() / 1e9)
            token, logprobs, n = None, None, len(replay)
            for n, (token, logprobs) in enumerate(steps, start=len(replay)):
                if token in eos:
                    break
                detokenizer.add_token(token)
                if n + 1 == max_tokens:
                    break
                yield GenerationResponse(text=detokenizer.last_segment, token=token, logprobs=logprobs,
                                         from_draft=False, prompt_tokens=len(tokens), prompt_tps=0.0,
                                         generation_tokens=n + 1,
                                         generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
                                         peak_memory=mx.get_peak_memory() / 1e9)
            detokenizer.finalize()
            writer.complete(store, key)
            yield GenerationResponse(text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=False,
                                     prompt_tokens=len(tokens), prompt_tps=0.0, generation_tokens=n + 1,
                                     generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
                                     peak_memory=mx.get_peak_memory() / 1e9,
                                     finish_reason="stop" if token in eos else "length")
    finally:
        steps.close()
        writer.flush()


__all__ = ["steps_with_generation_checkpoints", "default_key", "random_state", "resumable_generate", "set_random_state"]
