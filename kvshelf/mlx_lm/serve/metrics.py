"""What ``kvshelf serve`` counts: Prometheus metrics (``GET /metrics``) and the figures of the status page.

Why here and why so: an operator must see whether requests hit and why they miss without reading logs. The
prompt cache hands every fetch and every write-behind outcome to ``ServeMetrics`` (its ``observer``); this object
turns them into Prometheus counters (counters, never rate gauges: Prometheus computes rates), a restore-time
histogram per tier, and, for the status page, the hit rates over the last 1, 5 and 15 minutes and the last requests.
The store's own figures (bytes, budget, pinned bytes, evictions, quarantines) and the write queue are read when
scraped (a collector), so a scrape never waits on a request and a request never pays for them.

One way to add a metric: ``METRICS``, a table of ``MetricDefinition`` (name, type, help, labels, the label values
present from the start, and for a figure read at scrape time its reader). Every ``/metrics`` family is built from
that table by one collector; a metric counted by this process (``read`` None) is counted with ``_inc`` /
``_observe`` under its definition's name. Adding a metric is adding a row (and, for a counted one, the call that
counts it).

Each server process has its own registry (not the library's global one): two servers on one store each count
their own requests, as Prometheus expects of two targets; store gauges are the store's (shared) figures.

``prometheus_client`` is imported here only: the core of kvshelf imports without it (it comes with the ``mlx-lm``
extra).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .ram_tier import EVICTION_REASONS
from .prompt_cache import MISS_REASONS, SOURCES, WRITE_OUTCOMES, FetchOutcome

WINDOWS = (("1m", 60.0), ("5m", 300.0), ("15m", 900.0))
RECENT = 50            # last requests shown on the status page
WINDOW_EVENTS = 200_000  # fetches remembered for the 15-minute rates at most (bounded memory under any load)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TIERS = ("ram", "disk", "remote")
# the outcomes of --generation-checkpoint-every's writes (the label of kvshelf_generation_checkpoints_total)
GENERATION_CHECKPOINT_OUTCOMES = ("queued", "durable", "failed", "skipped_full", "dropped")


@dataclass(frozen=True)
class Scrape:
    """What a scrape reads once, for every definition with a reader: the server's ``state()`` and the store's
    figures (``store_figures``)."""

    state: dict[str, Any]
    figures: dict[str, Any]

    def generation(self, name: str) -> int:
        """A counter of the generation checkpoints (``generations.py``; 0 before the generator exists)."""
        return (self.state.get("generations") or {}).get(name, 0)


@dataclass(frozen=True)
class MetricDefinition:
    """One ``/metrics`` family. ``name`` without the ``_total`` a counter gets; ``kind``: counter, gauge or
    histogram; ``series``: label values present from the start (a rate over a missing series is no rate);
    ``read(scrape)``: the value (or ``{label values: value}``) of a figure read at scrape time, None for one this
    process counts; ``buckets``: a histogram's upper bounds."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    series: tuple[tuple[str, ...], ...] = ()
    read: Callable[[Scrape], Any] | None = None
    buckets: tuple[float, ...] = ()


def ram_figure(scrape: Scrape, name: str) -> int:
    """A figure of the RAM tier (ram_tier.BoundedRam.figures; 0 before the server built it)."""
    return int((scrape.state.get("ram") or {}).get(name, 0))


def evictions(scrape: Scrape) -> dict[tuple[str, str], int]:
    """kvshelf_evictions_total's series: the store's budget evictions, the RAM tier's by reason."""
    ram = (scrape.state.get("ram") or {}).get("evictions", {})
    return {("disk", "budget"): scrape.figures["evicted"],
            **{("ram", reason): int(ram.get(reason, 0)) for reason in EVICTION_REASONS}}


REMOTE_OPS = {"lookup": "lookup_errors", "restore": "restore_errors", "publish": "publish_failed"}


def remote_errors(scrape: Scrape) -> dict[tuple[str], int]:
    """kvshelf_remote_errors_total's series: the shared tier's failed calls by operation, over the open stores."""
    out = dict.fromkeys(((op,) for op in REMOTE_OPS), 0)
    for store in scrape.state.get("stores", []):
        tier = getattr(store, "tier", None)
        counters = getattr(tier, "counters", None) or {}
        for op, name in REMOTE_OPS.items():
            out[(op,)] += int(counters.get(name, 0))
    return out


def _each(values: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple((v,) for v in values)


def _generation(name: str, help_: str) -> MetricDefinition:
    return MetricDefinition(f"kvshelf_generation_{name}", "counter", help_, read=lambda s: s.generation(name))


METRICS: tuple[MetricDefinition, ...] = (
    # counted by this process (the prompt cache's observer calls)
    MetricDefinition("kvshelf_requests", "counter", "Requests by where their prompt prefix came from", ("source",),
                     _each(SOURCES)),
    MetricDefinition("kvshelf_prompt_tokens", "counter", "Prompt tokens of all requests", series=((),)),
    MetricDefinition("kvshelf_cached_tokens", "counter", "Prompt tokens served from a cache tier", ("tier",),
                     _each(TIERS)),
    MetricDefinition("kvshelf_misses", "counter", "Requests that got no cached prefix, by reason", ("reason",),
                     _each(MISS_REASONS)),
    MetricDefinition("kvshelf_restore_seconds", "histogram", "Time to fetch a prefix, by tier", ("tier",),
                     buckets=RESTORE_BUCKETS),
    MetricDefinition("kvshelf_writes", "counter", "Write-behinds by outcome", ("outcome",), _each(WRITE_OUTCOMES)),
    MetricDefinition("kvshelf_bytes_written", "counter", "Bytes written to the store (SSD wear)", series=((),)),
    MetricDefinition("kvshelf_checkpoint_hits", "counter", "Requests whose prefix came from a session's checkpoint "
                     "(--checkpoint-every)", series=((),)),
    MetricDefinition("kvshelf_ineffective_hits", "counter", "Hits that still prefilled more than prompt - cached + 1 "
                     "tokens (their caches held less than the lookup matched; ineffective_hits.py)", series=((),)),
    # read at scrape time: the store's figures and the write queue
    MetricDefinition("kvshelf_store_bytes", "gauge", "Bytes the store holds on disk (all identities)",
                     read=lambda s: s.figures["stored_bytes"]),
    MetricDefinition("kvshelf_store_budget_bytes", "gauge", "The store's budget (max_bytes; 0: none)",
                     read=lambda s: s.figures["max_bytes"] or 0),
    MetricDefinition("kvshelf_pinned_bytes", "gauge", "Bytes of the pinned sessions' snapshots",
                     read=lambda s: s.figures["pinned_bytes"]),
    MetricDefinition("kvshelf_write_queue_depth", "gauge", "Write-behinds in flight",
                     read=lambda s: s.state.get("pending_writes", 0)),
    MetricDefinition("kvshelf_evictions", "counter", "Entries dropped: tier=disk, snapshots this server evicted "
                     "to keep the budget; tier=ram, prompt caches left RAM to keep --prompt-cache-bytes (by reason)",
                     ("tier", "reason"), read=lambda s: evictions(s)),
    MetricDefinition("kvshelf_remote_errors", "counter", "Calls to the shared tier (--remote) that failed, by "
                     "operation (an outage: these grow, then the circuit breaker stops asking)", ("op",),
                     read=lambda s: remote_errors(s)),
    MetricDefinition("kvshelf_ram_bytes", "gauge", "Bytes of prompt caches the RAM tier holds",
                     read=lambda s: ram_figure(s, "bytes")),
    MetricDefinition("kvshelf_ram_budget_bytes", "gauge", "The RAM tier's bound (--prompt-cache-bytes)",
                     read=lambda s: ram_figure(s, "max_bytes")),
    MetricDefinition("kvshelf_ram_peak_bytes", "gauge", "The most bytes the RAM tier held after any insert",
                     read=lambda s: ram_figure(s, "peak_bytes")),
    MetricDefinition("kvshelf_quarantined", "counter", "Damaged snapshots this server quarantined",
                     read=lambda s: s.figures["quarantined"]),
    # --generation-checkpoint-every's counters (generations.py), read at scrape time
    MetricDefinition("kvshelf_generation_checkpoints", "counter", "Generation checkpoints by outcome (queued, "
                     "durable, failed, skipped_full: the write queue was full, dropped: by a completed request)",
                     ("outcome",), read=lambda s: {(o,): s.generation(f"checkpoints_{o}")
                                                   for o in GENERATION_CHECKPOINT_OUTCOMES}),
    _generation("resumes", "Requests resumed from a generation checkpoint"),
    _generation("resumed_tokens", "Generated tokens a resume did not decode again"),
    _generation("requests_not_resumable", "Requests served without checkpoints (sampled without a seed, or asking "
                                          "for logprobs)"),
    _generation("requests_short", "Resumable requests whose max_tokens cannot reach a checkpoint, left in mlx-lm's "
                                  "batch"),
    _generation("drops_failed", "Completed requests whose checkpoints could not be dropped"),
    _generation("requests_batched", "Checkpointed requests decoded as rows of mlx-lm's batch"),
    MetricDefinition("kvshelf_generation_batch_rows_peak", "gauge", "The most checkpointed requests one step of "
                     "mlx-lm's batch decoded together", read=lambda s: s.generation("batch_rows_peak")),
)
DEFINITIONS = {d.name: d for d in METRICS}


class _Series:
    """A counted series: its value (a counter) or bucket counts and sum (a histogram), and when it was created."""

    def __init__(self, buckets: int):
        self.value = 0.0
        self.buckets = [0] * (buckets + 1)  # the last one: above every bound (+Inf)
        self.created = time.time()


class ServeMetrics:
    """The server's counters. ``state()`` (a callable) gives the live figures read at scrape time: a dict with
    ``stores`` (open ``Store`` handles), ``pending_writes`` and ``pending_bytes`` (the write-behind queue) and
    ``generations`` (the generation checkpoints' counters, ``generations.py``)."""

    def __init__(self, state: Callable[[], dict[str, Any]] | None = None, *, clock: Callable[[], float] = time.time):
        self.registry = CollectorRegistry(auto_describe=True)
        self._state = state or (lambda: {"stores": [], "pending_writes": 0, "pending_bytes": 0})
        self._clock = clock
        self._lock = threading.Lock()
        self._series: dict[str, dict[tuple[str, ...], _Series]] = {d.name: {} for d in METRICS if d.read is None}
        for d in METRICS:
            for labels in d.series if d.read is None else ():
                self._get(d, labels)
        self.registry.register(_Families(self))
        self._events: deque[tuple[float, str]] = deque(maxlen=WINDOW_EVENTS)
        self._recent: deque[FetchOutcome] = deque(maxlen=RECENT)
        self.totals: Counter[str] = Counter()
        self.miss_totals: Counter[str] = Counter()
        self.write_totals: Counter[str] = Counter()
        self.bytes_written_total = 0

    # ------------------------------------------------------------------ counting by definition
    def _get(self, d: MetricDefinition, labels: tuple[str, ...]) -> _Series:
        if len(labels) != len(d.labels):
            raise ValueError(f"{d.name} takes the labels {d.labels}, got {labels}")
        series = self._series[d.name].get(labels)
        if series is None:
            series = self._series[d.name][labels] = _Series(len(d.buckets))
        return series

    def _inc(self, name: str, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._get(DEFINITIONS[name], labels).value += amount

    def _observe(self, name: str, value: float, *labels: str) -> None:
        d = DEFINITIONS[name]
        with self._lock:
            series = self._get(d, labels)
            series.buckets[bisect.bisect_left(d.buckets, value)] += 1
            series.value += value

    def families(self, scrape: Scrape):
        """Every ``/metrics`` family, in ``METRICS`` order."""
        for d in METRICS:
            if d.read is not None:
                values = d.read(scrape)
                values = values if isinstance(values, dict) else {(): values}
                if d.kind == "gauge":
                    family = GaugeMetricFamily(d.name, d.help, labels=d.labels)
                else:
                    family = CounterMetricFamily(d.name, d.help, labels=d.labels)
                for labels, value in values.items():
                    family.add_metric(list(labels), value)
                yield family
                continue
            with self._lock:
                series = [(labels, s.value, list(s.buckets), s.created) for labels, s in self._series[d.name].items()]
            if d.kind == "histogram":
                family = HistogramMetricFamily(d.name, d.help, labels=d.labels)
                for labels, total, counts, created in series:
                    cumulative, running = [], 0
                    for bound, count in zip((*d.buckets, float("inf")), counts):
                        running += count
                        cumulative.append((floatToGoString(bound), running))
                    family.add_metric(list(labels), cumulative, total)
                    family.samples.append(Sample(d.name + "_created", dict(zip(d.labels, labels)), created))
            else:
                family = CounterMetricFamily(d.name, d.help, labels=d.labels)
                for labels, value, _counts, created in series:
                    family.add_metric(list(labels), value, created=created)
            yield family

    # ------------------------------------------------------------------ the prompt cache's observer
    def observe_fetch(self, outcome: FetchOutcome) -> None:
        self._inc("kvshelf_requests", outcome.source)
        self._inc("kvshelf_prompt_tokens", amount=outcome.prompt)
        tier = outcome.tier if outcome.tier is not None else (outcome.source if outcome.source != "none" else None)
        if tier is not None:  # tokens not recomputed, counted whether or not the request counts as a hit
            self._inc("kvshelf_cached_tokens", tier, amount=outcome.cached)
        if outcome.source != "none":
            self._observe("kvshelf_restore_seconds", outcome.seconds, outcome.source)
            if outcome.prefix_checkpoint:
                self._inc("kvshelf_checkpoint_hits")
        else:
            self._inc("kvshelf_misses", outcome.reason or "nothing_stored")
        with self._lock:
            self._events.append((outcome.at, outcome.source, outcome.cached if tier else 0, outcome.prompt))
            self._recent.append(outcome)
            self.totals[outcome.source] += 1
            if outcome.source == "none":
                self.miss_totals[outcome.reason or "nothing_stored"] += 1

    def observe_ineffective_hit(self, _source: str) -> None:
        self._inc("kvshelf_ineffective_hits")

    def observe_write(self, outcome: str, bytes_written: int, tokens: int) -> None:
        self._inc("kvshelf_writes", outcome)
        if bytes_written:
            self._inc("kvshelf_bytes_written", amount=bytes_written)
        with self._lock:
            self.write_totals[outcome] += 1
            self.bytes_written_total += bytes_written

    # ------------------------------------------------------------------ reading
    def exposition(self) -> bytes:
        """The text exposition format of every metric (``GET /metrics``)."""
        return generate_latest(self.registry)

    def hit_rates(self) -> dict[str, dict[str, Any]]:
        """Per window: requests, each source's share of them (None when there were none; a hit is what
        ``--min-hit-tokens`` says, hit_policy.py), and the token figures: ``prompt_tokens``, ``cached_tokens`` and
        ``token_share`` (the share of prompt tokens not recomputed)."""
        now = self._clock()
        with self._lock:
            events = list(self._events)
        out = {}
        for name, span in WINDOWS:
            window = [e for e in events if now - e[0] <= span]
            counts = Counter(e[1] for e in window)
            n = len(window)
            prompt, cached = sum(e[3] for e in window), sum(e[2] for e in window)
            out[name] = {"requests": n, **{s: (round(counts[s] / n, 4) if n else None) for s in SOURCES},
                         "hit": round(1 - counts["none"] / n, 4) if n else None,
                         "prompt_tokens": prompt, "cached_tokens": cached,
                         "token_share": round(cached / prompt, 4) if prompt else None}
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


class _Families:
    """The one collector: every family of ``METRICS``, figures read at scrape time (a scrape never waits on a
    request and a request never pays for them)."""

    def __init__(self, metrics: ServeMetrics):
        self._metrics = metrics

    def describe(self):
        return []

    def collect(self):
        state = self._metrics._state()
        yield from self._metrics.families(Scrape(state, store_figures(state.get("stores", []))))


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


__all__ = ["CONTENT_TYPE", "GENERATION_CHECKPOINT_OUTCOMES", "METRICS", "MetricDefinition", "Scrape", "ServeMetrics",
           "WINDOWS", "store_figures"]
