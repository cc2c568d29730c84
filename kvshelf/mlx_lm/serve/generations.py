"""``kvshelf serve``'s generations that survive a crash: generation checkpoints of running requests, and retries that
resume (docs/RESUMING.md; not the prefix checkpoints of ``--checkpoint-every``, ``prefix_checkpoints.py``).

Why: a client that loses the server at token 3,500 of 4,000 retries the identical request; without this it pays the
prefill and the 3,500 tokens again. Every ``--generation-checkpoint-every`` tokens a running request's caches
(prompt + generated so far), its pending token and its sampler's random state are written behind to the store
(``GenerationCheckpointWriter``: decode never waits; a full queue skips and counts). A request whose continuation key
has a checkpoint sends the tokens already generated at once (streaming: as the first chunks) and decodes on from the
pending token; its text and token ids equal an uninterrupted run's. A completed request drops its checkpoints; a
request the client abandoned keeps them (its retry resumes).

What is resumable: temperature 0, or any temperature with an explicit ``seed`` (the request samples from a random key
seeded with it — its own key in the batch, ``row_sampler.py`` — saved and restored with each checkpoint). A request with temperature > 0 and no seed has no
determined continuation: it is served by mlx-lm as before (counted in ``requests_not_resumable``). So are requests
asking for logprobs (a resumed answer has no logprobs for the replayed tokens), with images, or on a server with a
draft model.

The continuation key (:func:`request_key`) is a pure function of the request: sha256 of the canonical JSON of the
model identity, the prompt token ids, every sampling and penalty field, the stop sequences, ``max_tokens``, the
logit bias and the explicit seed (if any) — so a different request (another seed, ``max_tokens``, stop sequence,
system prompt) never resumes from another's checkpoint.

How it plugs in: resumable requests long enough to reach a checkpoint (``max_tokens`` above the interval) are rows of
mlx-lm's ``BatchGenerator`` like any other request (``batch_rows.py``: a row is checkpointed at a step boundary and a
retry re-enters the batch with its caches and pending token; a seeded row samples from a key of its own,
``row_sampler.py``). Only where mlx-lm serves every request one at a time anyway — a model whose caches mlx-lm cannot
batch, or ``--kv-bits`` — are they served by :meth:`ServeGenerations.serve` (mlx-lm's ``_serve_single`` with
:func:`~kvshelf.mlx_lm.resumable.steps_with_generation_checkpoints` as its decode loop). ``counters`` is a plain dict
the metrics can read.
"""

from __future__ import annotations

import argparse
import copy
import logging
import weakref
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.server import GenerationContext, Response

from ...store.generations import continuation_key
from ..generation_checkpoint_writer import COUNTERS, GenerationCheckpointWriter
from ..prefix_checkpoints import prefill
from ..resumable import steps_with_generation_checkpoints
from ..upstream import image_parts, make_logits_processors, make_sampler, should_stop

log = logging.getLogger("kvshelf.serve")


def generation_checkpoint_every_arg(text: str) -> int:
    """``--generation-checkpoint-every``: an int >= 0 (0: off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: off), got {value}")
    return value


def resumable(args: Any) -> bool:
    """Whether a request's continuation is determined (and its answer can be replayed): greedy or seeded, and no
    logprobs asked for."""
    sampled = float(args.sampling.temperature) > 0
    return (not sampled or args.seed is not None) and not args.logprobs and args.top_logprobs <= 0


def request_key(identity: Any, prompt: list[int], args: Any, cli_args: Any = None, scope: str = "") -> str:
    """The continuation key of a request (see the module docstring); ``scope`` is its tenant scope
    (``RequestContext.scope``): another tenant's identical request never resumes this one's generation."""
    s, lg = args.sampling, args.logits
    bias = None if lg.logit_bias is None else sorted([int(k), float(v)] for k, v in lg.logit_bias.items())
    fields = {
        "model": [identity.model_id, identity.config_fingerprint, identity.tokenizer_hash],
        "request_model": [args.model.model, args.model.draft, args.model.adapter],
        "prompt": [int(t) for t in prompt],
        "sampling": {"temperature": float(s.temperature), "top_p": float(s.top_p), "top_k": int(s.top_k),
                     "min_p": float(s.min_p), "xtc_probability": float(s.xtc_probability),
                     "xtc_threshold": float(s.xtc_threshold)},
        "penalties": {"repetition_penalty": float(lg.repetition_penalty or 0.0),
                      "repetition_context_size": int(lg.repetition_context_size),
                      "presence_penalty": float(lg.presence_penalty or 0.0),
                      "presence_context_size": int(lg.presence_context_size),
                      "frequency_penalty": float(lg.frequency_penalty or 0.0),
                      "frequency_context_size": int(lg.frequency_context_size)},
        "logit_bias": bias,
        "stop": list(args.stop_words),
        "max_tokens": int(args.max_tokens),
        "num_draft_tokens": int(args.num_draft_tokens or 0),
        "seed_mode": "explicit" if args.seed is not None else "none",
    }
    if args.seed is not None:
        fields["seed"] = int(args.seed)
    if scope:
        fields["scope"] = scope
    if cli_args is not None:
        fields["kv"] = [getattr(cli_args, "kv_bits", None), getattr(cli_args, "kv_group_size", None),
                        getattr(cli_args, "quantized_kv_start", None)]
    return continuation_key(fields)


class ServeGenerations:
    """Generation checkpoints and resumes for one server. ``every``: tokens between generation checkpoints (0: off,
    every request goes to mlx-lm unchanged); ``store_for(model_key) -> Store | None`` as the tiered prompt cache uses
    it."""

    def __init__(self, every: int, store_for: Any, *, max_in_flight: int = 4, logger: logging.Logger | None = None):
        if every < 0:
            raise ValueError(f"--generation-checkpoint-every must be >= 0, got {every}")
        self.every = every
        self.store_for = store_for
        self.log = logger or log
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.writer = GenerationCheckpointWriter(max_in_flight=max_in_flight, counters=self.counters, logger=self.log)
        self._counted: dict[int, weakref.ref] = {}  # the requests already counted (``_count``), while they live

    def takes(self, args: Any) -> bool:
        """Whether the request is ours: checkpointed and resumable (in mlx-lm's batch where :meth:`batches`, else by
        :meth:`serve`). A request whose ``max_tokens`` does not exceed the interval never writes a checkpoint (and
        none can exist to resume it from), so mlx-lm serves it as it would (counted in ``requests_short``)."""
        why = self._not_ours(args)
        if why is not None and why != "off":
            self._count(why, args)
        return why is None

    def _not_ours(self, args: Any) -> str | None:
        """Why mlx-lm serves the request as before (``"off"``, or the counter that counts it); None: it is ours."""
        if not self.every:
            return "off"
        if not resumable(args):
            return "requests_not_resumable"
        limit = getattr(args, "max_tokens", None)
        if isinstance(limit, int) and 0 < limit <= self.every:
            return "requests_short"
        return None

    def _count(self, name: str, args: Any) -> None:
        """Once per request: mlx-lm's loop asks again for a request it re-queued (to start or drain a batch)."""
        key = id(args)  # by identity: mlx-lm's arguments are an unhashable dataclass
        seen = self._counted.get(key)
        if seen is not None and seen() is args:
            return
        try:
            self._counted[key] = weakref.ref(args, lambda _ref, key=key: self._counted.pop(key, None))
        except TypeError:  # arguments that cannot be weakly referenced: counted each time asked
            pass
        self.counters[name] += 1

    def batches(self, provider: Any) -> bool:
        """Whether this server's resumable requests join mlx-lm's batch: mlx-lm batches the model (no draft model,
        caches that merge) and the KV cache is not quantized (``--kv-bits``: mlx-lm serves one at a time)."""
        return bool(provider.is_batchable) and getattr(provider.cli_args, "kv_bits", None) is None

    def open_row(self, request: Any, args: Any, prompt: list[int], provider: Any):
        """For a request about to join the batch: ``(store, continuation key, checkpoint or None, tenant)`` when it is
        ours (resumable, long enough, no images, a store), None when mlx-lm serves it as it is. The tenant files the
        row's checkpoints in its namespace, so ``forget_tenant`` removes them with the rest of its data."""
        if self._not_ours(args) is not None or provider.draft_model is not None:
            return None
        if any(image_parts(request.messages)):
            return None
        store = self._store(provider.model_key)
        if store is None:
            return None
        context = getattr(request, "kvshelf_context", None)
        key = request_key(store.identity, prompt, args, provider.cli_args, getattr(context, "scope", ""))
        tenant = getattr(context, "tenant", "")
        return store, key, self._find(store, key, prompt, tenant), tenant

    def counted_resume(self, found: Any, max_tokens: int) -> None:
        """A request resumes from ``found``: counted and logged (the log line operators and tests wait on)."""
        self.counters["resumes"] += 1
        self.counters["resumed_tokens"] += len(found.generated)
        self.log.info("kvshelf resume from=%d of max_tokens=%d key=%s", len(found.generated), max_tokens, found.key)

    def _store(self, model_key: Any):
        try:
            return self.store_for(model_key)
        except Exception as exc:  # noqa: BLE001 - no store: mlx-lm serves the request as before
            self.log.warning("kvshelf store unavailable for generation checkpoints: %s: %s", type(exc).__name__, exc)
            return None

    def _find(self, store: Any, key: str, prompt: list[int], tenant: str = ""):
        try:
            return store.find_generation_checkpoint(key, prompt, tenant=tenant)
        except Exception as exc:  # noqa: BLE001 - a damaged checkpoint is quarantined by the store: start over
            self.log.warning("kvshelf generation checkpoint lookup failed, starting over: %s: %s",
                             type(exc).__name__, exc)
            return None

    def serve(self, request: tuple, stream: Any, *, provider: Any, tokenize: Any, state_machine: Any,
              prompt_cache: Any) -> bool:
        """Serve one request as mlx-lm's ``_serve_single`` would, checkpointed and resuming; False (nothing done)
        when this request is not for us and mlx-lm must serve it."""
        rqueue, req, args = request
        if self._not_ours(args) is not None or provider.draft_model is not None or any(image_parts(req.messages)):
            return False
        store = self._store(provider.model_key)
        if store is None:
            return False
        try:
            self._serve(rqueue, req, args, stream, store, provider, tokenize, state_machine, prompt_cache)
        except Exception as exc:  # noqa: BLE001 - as mlx-lm: the error goes to the request
            rqueue.put(exc)
        return True

    @staticmethod
    def _segment_ends(provider, prompt_cache, prompt: list[int], segments, segment_types, cache, cached: int) -> int:
        """As mlx-lm's batch path does: the cache at the end of every segment (the system prompt, the user turn,
        ``--checkpoint-every`` boundaries; the last one ends a token early, as that token is the first decode step's
        input) goes into the prompt cache, so later requests reuse those boundaries; returns the positions now
        prefilled. A copy goes in: prefill goes on in ``cache``."""
        end = 0
        for i, (segment, kind) in enumerate(zip(segments, segment_types)):
            end += len(segment)
            if i == len(segments) - 1:
                end = len(prompt) - 1
            if end <= cached:
                continue
            prefill(provider.model, prompt[cached:end], cache, every=0, step=provider.cli_args.prefill_step_size)
            cached = end
            prompt_cache.insert_cache(provider.model_key, prompt[:end], copy.deepcopy(cache), cache_type=kind)
        return cached

    def _serve(self, rqueue, req, args, stream, store, provider, tokenize, state_machine, prompt_cache) -> None:
        model, tokenizer, cli = provider.model, provider.tokenizer, provider.cli_args
        prompt, segments, segment_types, initial_state, _ = tokenize(tokenizer, req, args)
        stop_sequences, text_sm = state_machine(provider.model_key, tokenizer, args.stop_words)
        ctx = GenerationContext(has_thinking=tokenizer.has_thinking, has_tool_calling=tokenizer.has_tool_calling,
                                tool_parser=tokenizer.tool_parser, text_sm=text_sm, initial_state=initial_state,
                                prompt=prompt)
        rqueue.put(ctx)
        context = getattr(req, "kvshelf_context", None)
        key = request_key(store.identity, prompt, args, cli, getattr(context, "scope", ""))
        tenant = getattr(context, "tenant", "")  # filed in the tenant's namespace: forget_tenant removes them
        found = self._find(store, key, prompt, tenant)
        if found is not None:
            cache, cached = found.caches, len(prompt)
            ctx.prompt_cache_count = cached
            self.counted_resume(found, args.max_tokens)
        else:
            if args.seed is not None:
                mx.random.seed(args.seed)
            cache, rest = prompt_cache.fetch_nearest_cache(provider.model_key, prompt[:])
            cached = len(prompt) - len(rest)
            if cache is None:
                cache = make_prompt_cache(model)
            ctx.prompt_cache_count = cached  # what the caches held; the segment prefill below is computed work
            cached = self._segment_ends(provider, prompt_cache, prompt, segments, segment_types, cache, cached)

        def on_generation_checkpoint(tokens, caches, pending, state):
            self.writer.submit(store, key, tokens, caches, prompt_length=len(prompt), pending_token=pending,
                               sampler_state=state, tenant=tenant)

        steps = steps_with_generation_checkpoints(
            model, prompt, prompt_cache=cache, cached=cached, resume=found, max_tokens=args.max_tokens,
            sampler=make_sampler(args, tokenizer), logits_processors=make_logits_processors(args),
            every=self.every, on_generation_checkpoint=on_generation_checkpoint, stream=stream,
            prefill_step_size=cli.prefill_step_size, kv_bits=cli.kv_bits, kv_group_size=cli.kv_group_size,
            quantized_kv_start=cli.quantized_kv_start, prompt_progress_callback=lambda a, b: rqueue.put((a, b)))
        detokenizer, eos = tokenizer.detokenizer, tokenizer.eos_token_ids
        stop_matcher = stop_sequences.matcher()
        all_tokens = prompt[:]
        replay = found.generated if found is not None else []
        for token in replay:  # at once: streaming clients get them as the first chunks
            detokenizer.add_token(token)
            stop_matcher.advance(token)
            rqueue.put(Response(detokenizer.last_segment, token, 0.0, None, ()))
            all_tokens.append(token)
        finished = False
        try:
            for n, (token, _logprobs) in enumerate(steps, start=len(replay)):
                # stream_generate's rules: EOS is not detokenized, max_tokens ends with "length"
                finish = None
                if token in eos:
                    finish = "stop"
                else:
                    detokenizer.add_token(token)
                    if n + 1 == args.max_tokens:
                        finish = "length"
                if finish is not None:
                    detokenizer.finalize()
                if stop_matcher.advance(token):
                    finish = "stop"
                rqueue.put(Response(detokenizer.last_segment, token, 0.0, finish, ()))
                all_tokens.append(token)
                if finish is not None:
                    finished = True
                    break
                if should_stop(ctx):  # the client went away: keep the checkpoints, its retry resumes
                    break
        finally:
            steps.close()
        rqueue.put(None)
        if finished:
            self.writer.complete(store, key, tenant=tenant)
        prompt_cache.insert_cache(provider.model_key, all_tokens, cache)


__all__ = ["ServeGenerations", "generation_checkpoint_every_arg", "request_key", "resumable"]
