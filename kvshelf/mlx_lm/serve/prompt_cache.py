"""A two-tier prompt cache for mlx-lm's server: mlx-lm's own ``LRUPromptCache`` in RAM, a kvshelf store on disk.

Why: mlx-lm's server keeps prompt caches in RAM only, so a restart loses every conversation and two server processes
share nothing. ``TieredPromptCache`` has the very interface the server calls (``fetch_nearest_cache``,
``insert_cache``, ``trim_to``, ``nbytes``, ``len``, ``stats_by_type``) and drops in where the server's
``LRUPromptCache`` was; that ``LRUPromptCache`` stays in front as the RAM tier, unchanged.

- fetch: RAM first (mlx-lm's trie, deep copies, its trimming rules). When RAM has nothing or less than the longest
  prefix disk could give (``len(tokens) - 1``), the store is asked for its longest *usable* prefix (``lookup``:
  token-verified, floor- and trim-aware, recurrent and rotating layers only where exact) and only that prefix is
  read (``restore_snapshot(id, length)``). A restored cache is a fresh object, the caller may mutate it.
- insert: into RAM as mlx-lm does, and written behind to the store (``save_async``). ``save_async`` snapshots and
  evaluates the caches at once in the calling thread (so later in-place updates by mlx-lm cannot leak into the
  write) and writes in the background. The write-behind queue is bounded in entries and bytes; when it is full
  the write is skipped and counted, generation never waits for the disk.
- the store never takes the server down: every store failure (full disk, budget, a corrupt or busy store) is
  logged and counted, and the answer comes from RAM (or a cold prefill). A damaged disk entry is a miss (the
  store quarantines it). The store's ``max_bytes`` and LRU govern the disk.

- write only what is new: before a write-behind is captured (captured = evaluated and hashed), the store is asked
  whether it can already give back these exact tokens (a lookup of the tokens plus one: a usable prefix of all of
  them is the answer). If so the write is skipped and counted ``duplicate``: a replayed conversation, a
  restored prefix inserted again and a shared system prompt write nothing and hash nothing. Write-behinds shorter
  than ``min_write_tokens`` are not worth a pack and are skipped too.

One INFO log line per fetch (the server fetches once per request) says where the prefix came from and, for a miss,
why; write-behind lines are DEBUG::

    kvshelf prefix source=disk cached=812 prompt=845 ram=0 ms=4.1
    kvshelf prefix source=none cached=0 prompt=845 ram=0 ms=0.3 reason=nothing_stored

Sources: ``ram``, ``disk``, ``remote`` (the store's shared tier gave the prefix), ``none``. Every fetch and every
write-behind outcome is also handed to ``observer`` (``observe_fetch(FetchOutcome)``, ``observe_write(outcome,
bytes_written, tokens)``): the server's metrics and status page; and the fetch outcome is kept for the HTTP handler
(``outcome_for``), which sends it back as the ``X-Kvshelf-Prefix`` header.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from ...errors import CorruptData, SnapshotNotFound
from ...store.save import BUSY, CLOSED, FULL, WriteBehindQueue
from .image_keys import storable_key, trusted_length
from .hit_policy import DEFAULT_MIN_HIT_TOKENS, classify
from .ineffective_hits import IneffectiveHits
from .prefix_checkpoints import PREFIX_CHECKPOINT, HeldPrefixCheckpoints
from .request_scopes import RequestScopes

log = logging.getLogger("kvshelf.serve")

COUNTERS = ("fetches", "ram_hits", "disk_hits", "remote_hits", "misses", "disk_tokens", "ram_tokens",
            "remote_tokens", "lookup_errors", "writes_queued", "writes_done", "writes_failed", "writes_skipped_full",
            "writes_skipped_unstorable", "writes_duplicate", "writes_skipped_short", "bytes_written",
            "store_unavailable", "checkpoint_hits", "writes_skipped_scope")  # checkpoint_hits: prefixes from a prefix checkpoint
SOURCES = ("ram", "disk", "remote", "none")
# why a request got nothing: the metric label ``reason`` of kvshelf_misses_total and the log line's reason=
MISS_REASONS = ("nothing_stored", "other_identity", "below_floor", "not_exact_length", "below_min_disk_tokens",
                "store_unavailable", "damaged_entry", "unstorable_tokens")
WRITE_OUTCOMES = ("saved", "duplicate", "queue_full", "failed", "below_min_write_tokens", "unstorable",
                  "unknown_tenant")
OUTCOMES_KEPT = 1024  # fetch outcomes waiting for their HTTP handler (a handler that never asks: dropped)


@dataclass(frozen=True)
class FetchOutcome:
    """Where one request's prefix came from: ``source`` (SOURCES), ``cached`` tokens of ``prompt``, the RAM tier's
    own length, the miss ``reason`` (None unless source is none), the fetch's seconds and its wall time."""

    source: str
    cached: int
    prompt: int
    ram: int
    reason: str | None
    seconds: float
    at: float
    prefix_checkpoint: bool = False  # the prefix came from a session's prefix checkpoint (serve/prefix_checkpoints.py)
    tier: str | None = None  # the tier whose tokens were reused, hit or not (hit_policy.py); None: none were

    def header(self) -> str:
        """The ``X-Kvshelf-Prefix`` header value."""
        return f"source={self.source} cached={self.cached} prompt={self.prompt}"


class _NoObserver:
    def observe_fetch(self, outcome: FetchOutcome) -> None:
        return None

    def observe_write(self, outcome: str, bytes_written: int, tokens: int) -> None:
        return None


def prompt_key(tokens: Sequence[int], scope: str = "") -> int:
    """The key a fetch outcome is kept under until the request's handler asks for it (the same prompt list, the same
    tenant scope: another tenant's handler never claims it)."""
    return hash((scope, len(tokens), tuple(tokens)))


def session_id_for(tokens: Sequence[int]) -> str:
    """The store session a token sequence is written under: a hash of the tokens, so every server writing the
    same sequence names the same session (the store then replaces, and its chunks are shared anyway)."""
    h = xxhash.xxh3_128()
    for t in tokens:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return f"prompt-{len(tokens)}-{h.hexdigest()}"


class _OneStore:
    """``store_for`` for a single store serving every model key (the library use: one model, one store)."""

    def __init__(self, store):
        self.store = store

    def __call__(self, _model_key: Any):
        return self.store

    def close(self) -> None:
        self.store.close()


class TieredPromptCache:
    """mlx-lm's ``LRUPromptCache`` in front, a kvshelf store behind (see the module docstring).

    ``ram``: the ``LRUPromptCache`` (kept as is). Give either ``store`` (one ``Store`` for every model key) or
    ``store_for(model_key) -> Store | None`` (an object with ``close()``; None = no disk tier for that key now).
    ``queue_entries`` / ``queue_bytes`` bound the writes in flight (a single entry larger than ``queue_bytes``
    goes through only when nothing else is queued). A disk prefix shorter than ``min_disk_tokens`` is not worth
    its read (recomputing a handful of tokens is cheaper than a restore) and is not taken.
    """

    def __init__(self, ram, store=None, *, store_for: Callable[[Any], Any] | None = None, namespace: str = "",
                 queue_entries: int = 8, queue_bytes: int = 1 << 30, min_disk_tokens: int = 16,
                 min_write_tokens: int = 1, observer: Any = None, logger: logging.Logger | None = None,
                 min_hit_tokens: int = DEFAULT_MIN_HIT_TOKENS):
        if (store is None) == (store_for is None):
            raise ValueError("give exactly one of store= and store_for=")
        if queue_entries < 1 or queue_bytes < 0:
            raise ValueError(f"queue_entries must be >= 1 and queue_bytes >= 0, got {queue_entries}, {queue_bytes}")
        self.ram = ram
        self._store_for = _OneStore(store) if store is not None else store_for
        self.namespace = namespace
        self.queue_entries, self.queue_bytes = queue_entries, queue_bytes
        self.min_disk_tokens = max(1, int(min_disk_tokens))
        self.min_write_tokens = max(1, int(min_write_tokens))
        self.min_hit_tokens = max(1, int(min_hit_tokens))  # a shorter prefix is a miss (hit_policy.py)
        self.observer = observer if observer is not None else _NoObserver()
        self._outcomes: OrderedDict[int, deque] = OrderedDict()
        self._outcome_cond = threading.Condition()
        self.log = logger or log
        self.counters = dict.fromkeys(COUNTERS, 0)
        # one write per session in flight (a second one is a duplicate), bounded in entries and bytes
        self.queue = WriteBehindQueue(max_entries=queue_entries, max_bytes=queue_bytes, logger=self.log)
        # --checkpoint-every's prefix checkpoint inserts, held until their session's (prefix_checkpoints.py)
        self.prefix_checkpoints = HeldPrefixCheckpoints()
        # the tenant scope of each call (request_scopes.py): part of the RAM key, the store namespace and the outcome
        self.scopes = RequestScopes()
        # a hit whose caches hold fewer tokens than it matched (ineffective_hits.py)
        self.ineffective = IneffectiveHits(self.observer, self.log)

    def announce_scope(self, scope: str) -> None:
        """The request tokenized last on this thread has tenant scope ``scope`` (``RequestContext.scope``): its
        fetch, and the inserts of its caches, are keyed by it in every tier."""
        self.scopes.announce(scope)

    @staticmethod
    def _ram_key(model: Any, scope: str) -> Any:
        """The RAM tier's model key: mlx-lm's own for the default scope, (model, scope) for a tenant's."""
        return (model, scope) if scope else model

    # ------------------------------------------------------------------ LRUPromptCache's interface
    def __len__(self) -> int:
        return len(self.ram)

    @property
    def nbytes(self) -> int:
        return self.ram.nbytes

    def stats_by_type(self) -> dict:
        return self.ram.stats_by_type()

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        self.ram.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        """``(cache, rest)`` as mlx-lm's: a copy the caller owns and the tokens still to process, or
        ``(None, tokens)``. Disk is asked only when it could beat RAM."""
        t0 = time.perf_counter()
        self.counters["fetches"] += 1
        scope = self.scopes.take(tokens)
        namespace = self.namespace + scope
        cache, rest = self.ram.fetch_nearest_cache(self._ram_key(model, scope), tokens)
        ram_len = len(tokens) - len(rest) if cache is not None else 0
        source, cached = ("ram", ram_len) if cache is not None else ("none", 0)
        reason, prefix_checkpoint = None, False
        stored = storable_key(tokens)  # image prompts: mlx-lm's negative ids mapped to storable ones (image_keys.py)
        if len(tokens) - 1 > ram_len and stored is not None:
            restored, reason = self._from_disk(model, stored, ram_len, namespace)
            if restored is not None:
                cache, cached, source, prefix_checkpoint = restored
                cache = self.ineffective.cut_short(cache)
                rest = tokens[cached:]
                self.counters["checkpoint_hits"] += prefix_checkpoint
        elif stored is None:
            reason = "unstorable_tokens"
        if cache is not None and (held := self.ineffective.check(tokens, cache, cached, source)) != cached:
            cached, rest = held, tokens[held:]
        verdict = classify(source, cached, reason, self.min_hit_tokens)  # --min-hit-tokens (hit_policy.py)
        source, reason = verdict.source, verdict.reason
        self.counters[f"{source}_hits" if source != "none" else "misses"] += 1
        if verdict.tier is not None:
            self.counters[f"{verdict.tier}_tokens"] += cached
        seconds = time.perf_counter() - t0
        outcome = FetchOutcome(source, cached, len(tokens), ram_len, reason, seconds, time.time(),
                               prefix_checkpoint, verdict.tier)
        self._keep_outcome(tokens, outcome, scope)
        self.observer.observe_fetch(outcome)
        self.log.info("kvshelf prefix source=%s cached=%d prompt=%d ram=%d ms=%.1f%s%s", source, cached, len(tokens),
                      ram_len, seconds * 1e3, f" reason={reason}" if reason else "",
                      " checkpoint=yes" if prefix_checkpoint else "")
        return cache, rest

    # ------------------------------------------------------------------ outcomes for the HTTP handler
    def _keep_outcome(self, tokens: Sequence[int], outcome: FetchOutcome, scope: str) -> None:
        key = prompt_key(tokens, scope)
        with self._outcome_cond:
            self._outcomes.setdefault(key, deque(maxlen=16)).append(outcome)
            self._outcomes.move_to_end(key)
            while len(self._outcomes) > OUTCOMES_KEPT:
                self._outcomes.popitem(last=False)
            self._outcome_cond.notify_all()

    def outcome_for(self, tokens: Sequence[int], timeout: float = 0.0, scope: str = "") -> FetchOutcome | None:
        """The (oldest unclaimed) fetch outcome of this prompt in this tenant scope, waiting up to ``timeout`` seconds
        for the fetch (mlx-lm may hand a streaming handler its context just before the fetch). Each outcome is
        claimed once."""
        key = prompt_key(tokens, scope)
        deadline = time.monotonic() + timeout
        with self._outcome_cond:
            while True:
                queue = self._outcomes.get(key)
                if queue:
                    outcome = queue.popleft()
                    if not queue:
                        del self._outcomes[key]
                    return outcome
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._outcome_cond.wait(left)

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        """Into RAM (mlx-lm's rules), then written behind to the store: snapshotted now, written later. A
        prefix checkpoint insert (``--checkpoint-every``) is held for its session's write instead."""
        scope = self.scopes.scope_of(tokens)
        if scope is None:  # two tenants' requests match these tokens, or none does: stored nowhere, never wrongly
            self.counters["writes_skipped_scope"] += 1
            self.observer.observe_write("unknown_tenant", 0, len(tokens))
            self.log.debug("kvshelf insert skipped: its tenant cannot be told (%d tokens)", len(tokens))
            return
        if cache_type == PREFIX_CHECKPOINT:
            self.prefix_checkpoints.hold(tokens, prompt_cache, scope)
            return
        self._write_behind(model, tokens, prompt_cache, self.namespace + scope, scope)
        self.ram.insert_cache(self._ram_key(model, scope), tokens, prompt_cache, cache_type=cache_type)

    # ------------------------------------------------------------------ disk tier
    def _store(self, model: Any):
        try:
            store = self._store_for(model)
        except Exception as exc:  # noqa: BLE001 - the disk tier is optional; never fail a request for it
            self.log.warning("kvshelf store unavailable: %s: %s", type(exc).__name__, exc)
            store = None
        if store is None:
            self.counters["store_unavailable"] += 1
        return store

    def _from_disk(self, model: Any, tokens: list[int], ram_len: int, namespace: str):
        """((caches, length, source), None) for a usable store prefix longer than RAM's, else (None, reason)."""
        store = self._store(model)
        if store is None:
            return None, "store_unavailable"
        for _attempt in range(2):
            try:
                hit = store.lookup(tokens, namespace)
                if hit is None:  # why (store.explain_miss): another identity's, below a floor, an uncuttable state
                    return None, store.explain_miss(tokens, namespace)
                hit = replace(hit, length=trusted_length(tokens, hit.length))  # never half an image's id
                if hit.length <= ram_len:
                    return None, "nothing_stored"
                if hit.length < self.min_disk_tokens:
                    return None, "below_min_disk_tokens"
                tier = getattr(store, "tier", None)
                source = "remote" if tier is not None and tier.knows(hit.snapshot_id) else "disk"
                restored = store.restore_snapshot(hit.snapshot_id, hit.length)
                return (restored.caches, hit.length, source, bool(getattr(hit, "checkpoint", False))), None
            except SnapshotNotFound:  # evicted or replaced between lookup and restore (another server), or a remote
                continue              # fault (the shared tier says so as not found): look again, then a miss
            except Exception as exc:  # noqa: BLE001 - a corrupt chunk is quarantined by the store: a miss here
                self.counters["lookup_errors"] += 1
                self.log.warning("kvshelf disk prefix failed, serving from RAM: %s: %s", type(exc).__name__, exc)
                damaged = isinstance(exc, CorruptData)
                return None, "damaged_entry" if damaged else "store_unavailable"
        return None, "nothing_stored"

    def _already_stored(self, store, tokens: list[int], namespace: str) -> bool:
        """True when the store can give back exactly these tokens' caches: a lookup of the tokens plus one token
        whose longest usable prefix is all of ``tokens`` (token-verified, no chunk read, nothing hashed). That
        snapshot may be longer (a later turn, trimmable); recurrent or rotating layers are usable only at their
        exact length, so for them it is a snapshot of exactly these tokens."""
        try:
            hit = store.lookup([*tokens, 0], namespace)
        except Exception:  # noqa: BLE001 - cannot tell: write it (the store replaces, chunks are shared anyway)
            return False
        return hit is not None and hit.length == len(tokens)

    def _write_behind(self, model: Any, tokens: list[int], prompt_cache: list[Any], namespace: str,
                      scope: str) -> None:
        try:
            held = self.prefix_checkpoints
            prefix_checkpoints = held.take_for(tokens, prompt_cache, scope) if len(held) else {}
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be cut: the session is still written
            self.log.warning("kvshelf prefix checkpoints dropped (%d tokens): %s: %s", len(tokens), type(exc).__name__,
                             exc)
            prefix_checkpoints = {}
        stored = storable_key(tokens) if tokens else None  # image prompts mapped (image_keys.py); None: RAM only
        if stored is None:
            self.counters["writes_skipped_unstorable"] += 1
            self.observer.observe_write("unstorable", 0, len(tokens))
            return
        tokens = stored
        if len(tokens) < self.min_write_tokens:
            self.counters["writes_skipped_short"] += 1
            self.observer.observe_write("below_min_write_tokens", 0, len(tokens))
            return
        store = self._store(model)
        if store is None:
            return
        session = session_id_for(tokens)
        queued_as = f"{scope}\x00{session}"  # one write per (tenant scope, session) in flight
        if self.queue.busy(queued_as) or self._already_stored(store, tokens, namespace):
            self._duplicate(tokens)
            return
        nbytes = sum(int(getattr(c, "nbytes", 0) or 0) for c in prompt_cache)

        def start():
            return store.save_async(session, list(tokens), prompt_cache, namespace=namespace,
                                    **({"checkpoints": prefix_checkpoints} if prefix_checkpoints else {}))

        def finished(future) -> None:
            self._finished(future, len(tokens), len(prefix_checkpoints))

        try:
            said = self.queue.submit(queued_as, nbytes, start, finished)
        except Exception as exc:  # noqa: BLE001 - e.g. a cache class no codec knows, a closed store
            self.counters["writes_failed"] += 1
            self.observer.observe_write("failed", 0, len(tokens))
            self.log.warning("kvshelf write-behind failed (%d tokens): %s: %s", len(tokens), type(exc).__name__, exc)
            return
        if said == CLOSED:
            return
        if said == BUSY:  # queued by another thread since the check above
            self._duplicate(tokens)
            return
        if said == FULL:
            self.counters["writes_skipped_full"] += 1
            self.observer.observe_write("queue_full", 0, len(tokens))
            self.log.warning("kvshelf write-behind skipped: queue full (%d writes, %d bytes pending)",
                             self.queue.pending, self.queue.pending_bytes)
            return
        self.counters["writes_queued"] += 1
        self.log.debug("kvshelf write-behind queued tokens=%d pending=%d", len(tokens), self.queue.pending)

    def _duplicate(self, tokens: list[int]) -> None:
        self.counters["writes_duplicate"] += 1
        self.observer.observe_write("duplicate", 0, len(tokens))
        self.log.debug("kvshelf write-behind skipped: the store holds these %d tokens already", len(tokens))

    def _finished(self, future, n_tokens: int, prefix_checkpoints: int = 0) -> None:
        exc = future.exception()
        if exc is None:
            info = future.result()
            self.counters["writes_done"] += 1
            self.counters["bytes_written"] += info.bytes_written
            self.observer.observe_write("saved", info.bytes_written, info.length)
            self.log.debug("kvshelf write-behind saved tokens=%d new_bytes=%d reused_bytes=%d ms=%.1f session=%s%s",
                          info.length, info.bytes_written, info.bytes_reused, info.seconds * 1e3, info.session_id,
                          f" checkpoints={prefix_checkpoints}" if prefix_checkpoints else "")
        else:
            self.counters["writes_failed"] += 1
            self.observer.observe_write("failed", 0, n_tokens)
            self.log.warning("kvshelf write-behind failed (%d tokens): %s: %s", n_tokens, type(exc).__name__, exc)

    @property
    def pending_writes(self) -> int:
        return self.queue.pending

    @property
    def pending_bytes(self) -> int:
        return self.queue.pending_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write finished (or ``timeout`` seconds passed); True when none is left."""
        return self.queue.flush(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop taking writes, flush within ``timeout`` and close the store(s). When writes are still running at
        the deadline they are abandoned (the store stays consistent: a crash-safe store leaves only orphans, which
        ``kvshelf gc`` reclaims) and False is returned."""
        flushed = self.queue.close(timeout)
        if flushed:
            self._store_for.close()
        self.log.info("kvshelf write-behind %s: %d saved, %d failed, %d skipped (queue full), %d abandoned, "
                      "%d duplicate (not written)", "flushed" if flushed else "abandoned at the deadline",
                      self.counters["writes_done"], self.counters["writes_failed"],
                      self.counters["writes_skipped_full"], self.queue.pending, self.counters["writes_duplicate"])
        return flushed


__all__ = ["COUNTERS", "FetchOutcome", "MISS_REASONS", "SOURCES", "TieredPromptCache", "WRITE_OUTCOMES", "prompt_key",
           "session_id_for"]
