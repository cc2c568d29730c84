"""Resumable requests as rows of mlx-lm's ``BatchGenerator``: checkpointed at step boundaries, resumed into the batch.

Why: serving a checkpointed request one at a time, outside mlx-lm's batch, costs N concurrent greedy users ~1/N of
plain mlx-lm's throughput where a batched decode step costs about what a single one does (a Mac's GPU). Here such a
request is an ordinary row of the batch, and this object does the three things generation checkpoints need of it:

- **Which insert is whose.** mlx-lm's loop tokenizes a request (``tokenize_request``, where the server calls
  :meth:`announce`), fetches its prompt cache, then calls ``insert_segments``; :meth:`claim` takes the announced
  request when the inserted prompt is exactly its prompt, and decides whether it is ours (``ServeGenerations``'s
  rules) and whether a checkpoint of its continuation key exists.
- **Resume into the batch.** A found checkpoint replaces the insert: the restored caches (prompt + generated), the
  pending token as a one-token prompt (mlx-lm feeds it straight to a decode step, no prefill), ``all_tokens`` =
  prompt + generated (the logits processors' history), ``max_tokens`` less what was emitted, the stop sequences'
  matchers advanced over the emitted tokens (:class:`ReplayedStops`) and a seeded row's key restored
  (``row_sampler.py``). The emitted tokens — generated and the pending one, which the batch feeds but never
  reports — are handed to mlx-lm's loop as responses of the row before any decoded one (:meth:`after_step`), so
  they go through the row's own detokenizer and reach the client first. A checkpoint whose pending token would end
  the request (EOS, a stop sequence, ``max_tokens``) is not resumed: the request starts over, exact and rare.
- **Checkpoint at a step boundary.** ``GenerationBatch._step`` feeds a row's current token and appends it to the
  row's tokens, so after the step that reported a row's ``n``-th token its cache holds prompt + ``n`` tokens and the
  token sampled from it is the row's *next* response. Every ``--generation-checkpoint-every`` tokens the row is
  extracted (``BatchGenerator.extract_cache``: a copy with the batch's left padding stripped, so it is what a
  single-request run would hold; MLX arrays are immutable, so it stays valid while the batch decodes on), with a
  seeded row's key as it is after that sampling; the next response gives the pending token and the checkpoint goes
  to the write-behind writer (decode never waits). A row that finishes (EOS, stop, length) drops its checkpoints;
  a row mlx-lm removes because its client went away keeps them (its retry resumes).

Counters (``ServeGenerations.counters``): ``requests_batched`` (checkpointed requests decoded in the batch) and
``batch_rows_peak`` (the most of them reported by one step of the batch).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import GenerationBatch

from .row_sampler import SeededRowSampler, key_bytes, row_sampler

log = logging.getLogger("kvshelf.serve")


class ReplayedStops:
    """mlx-lm's ``StopSequences`` whose matchers start advanced over ``tokens`` (a resumed row's emitted tokens), so
    a stop sequence spanning the resume point still ends the request where an uninterrupted run ends it."""

    def __init__(self, stops: Any, tokens: list[int]):
        self.stops = stops
        self.tokens = list(tokens)

    def matcher(self) -> Any:
        m = self.stops.matcher()
        for token in self.tokens:
            m.advance(token)
        return m

    def ends(self) -> bool:
        """Whether the replayed tokens themselves complete a stop sequence (its last token ends the request)."""
        m, done = self.stops.matcher(), False
        for token in self.tokens:
            done = m.advance(token)
        return done


class _NoLogprobs:
    """The logprobs of a replayed token: mlx-lm's loop reads ``logprobs[token].item()``; a resumable request never
    asks for logprobs, so 0.0 (as the single path answered)."""

    def __getitem__(self, _index: Any) -> _NoLogprobs:
        return self

    def item(self) -> float:
        return 0.0


@dataclass
class BatchRow:
    """One checkpointed request in the batch."""

    store: Any
    key: str
    prompt_length: int
    max_tokens: int
    tenant: str = ""  # the request's tenant: its checkpoints are filed in its namespace
    produced: int = 0  # tokens the client got (replayed included)
    sampler: SeededRowSampler | None = None
    replay: list[int] = field(default_factory=list)
    waiting: tuple | None = None  # an extracted checkpoint waiting for its pending token


class BatchRows:
    """The checkpointed rows of one server's batch; ``generations`` is its ``ServeGenerations`` (the rules, the
    store lookup, the writer and the counters)."""

    def __init__(self, generations: Any, *, logger: logging.Logger | None = None):
        self.generations = generations
        self.log = logger or log
        self.rows: dict[int, BatchRow] = {}
        self._fresh: list[int] = []  # rows inserted since the last step: their replay goes out first
        self._announced = threading.local()

    # ------------------------------------------------------------------ insert
    def announce(self, request: Any, args: Any, prompt: list[int], provider: Any) -> None:
        """The request mlx-lm's loop just tokenized on this thread (its insert, if any, follows)."""
        self._announced.value = (request, args, list(prompt), provider)

    def claim(self, segments: list, all_tokens: list | None, samplers: list | None, stop_sequences: list | None,
              max_tokens: list | None, caches: list | None) -> tuple[BatchRow, dict] | None:
        """For an insert of the announced request that is ours: its row and the insert's arguments (replaced for a
        resume); None: mlx-lm's insert as it is."""
        announced, self._announced.value = getattr(self._announced, "value", None), None
        if announced is None or len(segments) != 1 or not samplers or not stop_sequences:
            return None
        request, args, prompt, provider = announced
        head = list(all_tokens[0]) if all_tokens else []
        if head + [t for segment in segments[0] for t in segment] != prompt:
            return None  # not the announced request's insert
        opened = self.generations.open_row(request, args, prompt, provider)
        if opened is None:
            return None
        store, key, found, tenant = opened
        row = BatchRow(store=store, key=key, prompt_length=len(prompt), max_tokens=int(args.max_tokens),
                       tenant=tenant)
        inputs = {"segments": segments, "max_tokens": max_tokens, "caches": caches, "all_tokens": all_tokens,
                  "samplers": samplers, "stop_sequences": stop_sequences}
        if found is not None:
            emitted = [*found.generated, int(found.pending_token)]
            stops = ReplayedStops(stop_sequences[0], emitted)
            if len(emitted) >= row.max_tokens or stops.ends():
                self.log.info("kvshelf resume skipped: the checkpoint's pending token ends the request (generated=%d)",
                              len(found.generated))
                found = None
            else:
                self.generations.counted_resume(found, row.max_tokens)
                row.replay, row.produced = emitted, len(emitted)
                sampler = samplers[0]
                if args.seed is not None and found.sampler_state is not None:
                    sampler = row.sampler = SeededRowSampler.from_state(samplers[0], found.sampler_state)
                inputs.update(segments=[[[int(found.pending_token)]]], caches=[found.caches],
                              all_tokens=[list(found.tokens)], max_tokens=[row.max_tokens - len(emitted)],
                              samplers=[sampler], stop_sequences=[stops])
        if found is None:
            sampler = row_sampler(samplers[0], args.seed)
            row.sampler = sampler if isinstance(sampler, SeededRowSampler) else None
            inputs["samplers"] = [sampler]
        return row, inputs

    def started(self, uid: int, row: BatchRow) -> None:
        """``row`` is the batch's ``uid`` now."""
        self.rows[uid] = row
        self.generations.counters["requests_batched"] += 1
        if row.replay:
            self._fresh.append(uid)

    def removed(self, uids: list[int]) -> None:
        """mlx-lm removed these rows (their clients went away): forget them, keep their checkpoints."""
        for uid in uids:
            self.rows.pop(uid, None)
        self._fresh = [uid for uid in self._fresh if uid in self.rows]

    # ------------------------------------------------------------------ steps
    def after_step(self, batch: Any, responses: list) -> list:
        """The responses of one ``BatchGenerator.next()`` as mlx-lm's loop must see them: resumed rows' replayed
        tokens first, then the step's own; the checkpoints of this step taken or submitted."""
        out = []
        for uid in self._fresh:
            row = self.rows[uid]
            out.extend(GenerationBatch.Response(uid, token, _NoLogprobs(), None, None, None) for token in row.replay)
            row.replay = []
        self._fresh = []
        decoding = 0
        for r in responses:
            row = self.rows.get(r.uid)
            if row is not None:
                decoding += 1
                try:
                    self._advance(batch, r.uid, row, r)
                except Exception as exc:  # noqa: BLE001 - a checkpoint is an optimisation: never fail the batch
                    self.generations.counters["checkpoints_failed"] += 1
                    self.log.warning("kvshelf generation checkpoint failed: %s: %s", type(exc).__name__, exc)
            out.append(r)
        counters = self.generations.counters
        counters["batch_rows_peak"] = max(counters["batch_rows_peak"], decoding)
        return out

    def _advance(self, batch: Any, uid: int, row: BatchRow, r: Any) -> None:
        row.produced += 1
        writer = self.generations.writer
        if row.waiting is not None:
            tokens, caches, key = row.waiting
            row.waiting = None
            if r.finish_reason is None:  # r.token is the pending token of the extracted state
                writer.submit(row.store, row.key, tokens, caches, prompt_length=row.prompt_length,
                              pending_token=int(r.token), sampler_state=None if key is None else key_bytes(key),
                              tenant=row.tenant)
        if r.finish_reason is not None:
            self.rows.pop(uid, None)
            writer.complete(row.store, row.key, tenant=row.tenant)
            return
        every = self.generations.every
        if every and row.produced % every == 0 and row.produced != row.max_tokens:
            extracted = batch.extract_cache([uid]).get(uid)
            if extracted is None:
                return
            caches, tokens = extracted
            if len(tokens) != row.prompt_length + row.produced:  # never write a state that is not this one
                self.log.warning("kvshelf generation checkpoint skipped: the row holds %d tokens, expected %d",
                                 len(tokens), row.prompt_length + row.produced)
                return
            row.waiting = (list(tokens), caches, None if row.sampler is None else row.sampler.key)


__all__ = ["BatchRow", "BatchRows", "ReplayedStops"]
