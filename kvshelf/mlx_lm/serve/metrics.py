"""What ``kvshelf serve`` counts: Prometheus metrics (``GET /metrics``) and the figures of the status page.

Why here and why so: an operator must see whether requests hit and why they miss without reading logs. The
prompt cache hands every fetch and every write-behind outcome to ``ServeMetrics`` (its ``observer``); this object
turns them into Prometheus counters (counters, never rate gauges: Prometheus computes rates), a restore-time
histogram per tier, and, for the status page, the hit rates over the last 1, 5 and 15 minutes and the last requests.
The store's own figures (bytes, budget, pinned bytes, evictions, quarantines) and the write queue are read when
scraped (a collector), so a scrape never waits on a request and a request never pays for them.

Each server process has its own registry (not the library's global one): two servers on one store each count
their own requests, as Prometheus expects of two targets; store gauges are the store's (shared) figures.

``prometheus_client`` is imported here only: the core of kvshelf imports without it (it comes with the ``mlx-lm``
extra).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter as PromCounter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .prompt_cache import MISS_REASONS, SOURCES, WRITE_OUTCOMES, FetchOutcome

WINDOWS = (("1m", 60.0), ("5m", 300.0), ("15m", 900.0))
RECENT = 50            # last requests shown on the status page
WINDOW_EVENTS = 200_000  # fetches remembered for the 15-minute rates at most (bounded memory under any load)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """The server's counters. ``state()`` (a callable) gives the live figures read at scrape time: a dict with
    ``stores`` (open ``Store`` handles), ``pending_writes`` and ``pending_bytes`` (the write-behind queue) and
    ``generations`` (the generation checkpoints' counters, ``generations.py``)."""

    def __init__(self, state: Callable[[], dict[str, Any]] | None = None, *, clock: Callable[[], float] = time.time):
        self.registry = CollectorRegistry(auto_describe=True)
        self._state = state or (lambda: {"stores": [], "pending_writes": 0, "pending_bytes": 0})
        self._clock = clock
        self._lock = threading.Lock()
        self.requests = PromCounter("kvshelf_requests", "Requests by where their prompt prefix came from",
                                    ["source"], registry=self.registry)
        self.prompt_tokens = PromCounter("kvshelf_prompt_tokens", "Prompt tokens of all requests",
                                         registry=self.registry)
        self.cached_tokens = PromCounter("kvshelf_cached_tokens", "Prompt tokens served from a cache tier",
                                         ["tier"], registry=self.registry)
        self.misses = PromCounter("kvshelf_misses", "Requests that got no cached prefix, by reason", ["reason"],
                                  registry=self.registry)
        self.restore_seconds = Histogram("kvshelf_restore_seconds", "Time to fetch a prefix, by tier", ["tier"],
                                         buckets=RESTORE_BUCKETS, registry=self.registry)
        self.writes = PromCounter("kvshelf_writes", "Write-behinds by outcome", ["outcome"], registry=self.registry)
        self.bytes_written = PromCounter("kvshelf_bytes_written", "Bytes written to the store (SSD wear)",
                                         registry=self.registry)
        self.checkpoint_hits = PromCounter("kvshelf_checkpoint_hits", "Requests whose prefix came from a session's "
                                           "checkpoint (--checkpoint-every)", registry=self.registry)
        for source in SOURCES:  # every series exists from the start: a rate over a missing series is no rate
            self.requests.labels(source=source)
        for tier in ("ram", "disk", "remote"):
            self.cached_tokens.labels(tier=tier)
        for reason in MISS_REASONS:
            self.misses.labels(reason=reason)
        for outcome in WRITE_OUTCOMES:
            self.writes.labels(outcome=outcome)
        self.registry.register(_StoreCollector(self._state))
        self._events: deque[tuple[float, str]] = deque(maxlen=WINDOW_EVENTS)
        self._recent: deque[FetchOutcome] = deque(maxlen=RECENT)
        self.totals: Counter[str] = Counter()
        self.miss_totals: Counter[str] = Counter()
        self.write_totals: Counter[str] = Counter()
        self.bytes_written_total = 0

    # ------------------------------------------------------------------ the prompt cache's observer
    def observe_fetch(self, outcome: FetchOutcome) -> None:
        self.requests.labels(source=outcome.source).inc()
        self.prompt_tokens.inc(outcome.prompt)
        if outcome.source != "none":
            self.cached_tokens.labels(tier=outcome.source).inc(outcome.cached)
            self.restore_seconds.labels(tier=outcome.source).observe(outcome.seconds)
            if getattr(outcome, "checkpoint", False):
                self.checkpoint_hits.inc()
        else:
            self.misses.labels(reason=outcome.reason or "nothing_stored").inc()
        with self._lock:
            self._events.append((outcome.at, outcome.source))
            self._recent.append(outcome)
            self.totals[outcome.source] += 1
            if outcome.source == "none":
                self.miss_totals[outcome.reason or "nothing_stored"] += 1

    def observe_write(self, outcome: str, bytes_written: int, tokens: int) -> None:
        self.writes.labels(outcome=outcome).inc()
        if bytes_written:
            self.bytes_written.inc(bytes_written)
        with self._lock:
            self.write_totals[outcome] += 1
            self.bytes_written_total += bytes_written

    # ------------------------------------------------------------------ reading
    def exposition(self) -> bytes:
        """The text exposition format of every metric (``GET /metrics``)."""
        return generate_latest(self.registry)

    def hit_rates(self) -> dict[str, dict[str, Any]]:
        """Per window: requests, and each source's share of them (None when there were none)."""
        now = self._clock()
        with self._lock:
            events = list(self._events)
        out = {}
        for name, span in WINDOWS:
            counts = Counter(source for at, source in events if now - at <= span)
            n = sum(counts.values())
            out[name] = {"requests": n, **{s: (round(counts[s] / n, 4) if n else None) for s in SOURCES}}
        return out

    def recent(self) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._recent)
        return [{"at": o.at, "source": o.source, "cached": o.cached, "prompt": o.prompt, "reason": o.reason,
                 "ms": round(o.seconds * 1e3, 2)} for o in reversed(items)]

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": {s: self.totals[s] for s in SOURCES}, "misses": dict(self.miss_totals),
                    "writes": {o: self.write_totals[o] for o in WRITE_OUTCOMES},
                    "bytes_written": self.bytes_written_total}


class _StoreCollector:
    """The store's figures and the write queue, read at scrape time."""

    def __init__(self, state: Callable[[], dict[str, Any]]):
        self._state = state

    def describe(self):
        return []

    def collect(self):
        state = self._state()
        figures = store_figures(state.get("stores", []))
        gauges = (("kvshelf_store_bytes", "Bytes the store holds on disk (all identities)", figures["stored_bytes"]),
                  ("kvshelf_store_budget_bytes", "The store's budget (max_bytes; 0: none)", figures["max_bytes"] or 0),
                  ("kvshelf_pinned_bytes", "Bytes of the pinned sessions' snapshots", figures["pinned_bytes"]),
                  ("kvshelf_write_queue_depth", "Write-behinds in flight", state.get("pending_writes", 0)))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("kvshelf_evictions", "Snapshots this server evicted to keep the budget",
                                  value=figures["evicted"])
        yield CounterMetricFamily("kvshelf_quarantined", "Damaged snapshots this server quarantined",
                                  value=figures["quarantined"])
        yield from generation_families(state.get("generations") or {})


CHECKPOINT_OUTCOMES = ("queued", "durable", "failed", "skipped_full", "dropped")


def generation_families(counters: dict[str, int]):
    """``--generation-checkpoint-every``'s counters (``generations.py``), every series present from the start."""
    family = CounterMetricFamily("kvshelf_generation_checkpoints", "Generation checkpoints by outcome (queued, "
                                 "durable, failed, skipped_full: the write queue was full, dropped: by a completed "
                                 "request)", labels=["outcome"])
    for outcome in CHECKPOINT_OUTCOMES:
        family.add_metric([outcome], counters.get(f"checkpoints_{outcome}", 0))
    yield family
    for name, doc in (("resumes", "Requests resumed from a generation checkpoint"),
                      ("resumed_tokens", "Generated tokens a resume did not decode again"),
                      ("requests_not_resumable", "Requests served without checkpoints (sampled without a seed, "
                                                 "or asking for logprobs)"),
                      ("requests_short", "Resumable requests whose max_tokens cannot reach a checkpoint, left in "
                                         "mlx-lm's batch"),
                      ("drops_failed", "Completed requests whose checkpoints could not be dropped")):
        yield CounterMetricFamily(f"kvshelf_generation_{name}", doc, value=counters.get(name, 0))


def store_figures(stores: list) -> dict[str, Any]:
    """Bytes, budget, pins and this process's evictions and quarantines over the open store handles (one store
    directory, one handle per model identity): store-wide figures from the first, counters summed."""
    out: dict[str, Any] = {"stored_bytes": 0, "max_bytes": None, "pinned_bytes": 0, "evicted": 0, "quarantined": 0,
                           "snapshots": 0, "root": None, "pins": [], "error": None}
    for i, store in enumerate(stores):
        try:
            st = store.stats()
        except Exception as exc:  # noqa: BLE001 - a damaged or closing store: the page says so, the scrape works
            out["error"] = f"{type(exc).__name__}: {exc}"
            continue
        out["evicted"] += int(st.get("evicted", 0))
        out["quarantined"] += int(st.get("quarantined", 0))
        out["snapshots"] += int(st.get("snapshots", 0))
        if i == 0:
            out.update(stored_bytes=int(st.get("stored_bytes", 0)), max_bytes=st.get("max_bytes"),
                       pinned_bytes=int(st.get("pinned_bytes", 0)), root=st.get("root"))
            try:
                out["pins"] = [{"session_id": p.session_id, "namespace": p.namespace, "bytes": p.nbytes,
                                "expires_at": p.expires_at} for p in store.pins.listing()]
            except Exception as exc:  # noqa: BLE001 - as above
                out["error"] = f"{type(exc).__name__}: {exc}"
    return out


__all__ = ["CHECKPOINT_OUTCOMES", "CONTENT_TYPE", "ServeMetrics", "WINDOWS", "generation_families", "store_figures"]
