"""``kvshelf serve``: mlx-lm's OpenAI-compatible server, unchanged, with a persistent and shared prefix cache.

Why: mlx-lm's server keeps its prompt caches in RAM (``LRUPromptCache``); a restart loses every conversation and
two processes share nothing. This module runs ``mlx_lm.server.main`` itself (every option, the HTTP handler,
batching, logging set-up) and changes one thing.

The injection point: ``mlx_lm.server.run()`` builds ``LRUPromptCache(prompt_cache_size)`` and hands it to
``ResponseGenerator(model_provider, prompt_cache)``; the generation thread then only calls the prompt cache's
``fetch_nearest_cache`` / ``insert_cache`` / ``trim_to`` / ``nbytes`` / ``len`` / ``stats_by_type``. While
``main`` runs, ``mlx_lm.server.run`` is ``_run`` (below): the same steps, except that the generator is a subclass
whose constructor gets a :class:`TieredPromptCache` wrapping that very ``LRUPromptCache`` (kept as the RAM tier),
and the HTTP handler is a subclass adding kvshelf's routes and header. Nothing else of mlx-lm is replaced.
Resumable requests (greedy or seeded) are checkpointed and resumed by ``generations.ServeGenerations`` (docs/RESUMING.md):
as rows of mlx-lm's batch, whose ``BatchGenerator`` (the name ``mlx_lm.server`` builds it by) is, while ``main``
runs, ``checkpointed_batch.CheckpointedBatchGenerator`` bound to the server's ``batch_rows.BatchRows``. Private mlx-lm names (``_run_http_server``, the generator's
``_tokenize`` and the other hooks) are reached through ``kvshelf.mlx_lm.upstream`` only; the bound address is printed
once the socket listens (``listening.py``: ``--port 0`` works).

Stores: one handle per model identity (``model_identity``: the weights' content fingerprint or ``--model-id``,
config.json and safetensors headers, tokenizer files, KV settings, codec format tags), opened for the default model before the HTTP server starts and lazily for models a
request names. A store that cannot be opened (busy, damaged, missing permissions) leaves the server on RAM only
and is retried every ``--store-retry`` seconds. Several servers may share one store directory.

Start-up (``startup.py``): the model's files, the store directory and the ``--remote`` URL are checked before
anything heavy; then the default model is loaded and its store opened in the main thread, and ``--warm-prompts`` are
prefilled (``warm.py``), all before the HTTP server listens: a start-up mistake is a clear message and exit 1. For
this, ``mlx_lm.server.run`` is replaced (while ``main`` runs) by ``_run``, which does what mlx-lm's ``run`` does
in that order and hands mlx-lm's ``_run_http_server`` our handler (``http_routes.py``: ``/metrics``, the status page
``/kvshelf`` and ``/kvshelf/stats``, the ``X-Kvshelf-Prefix`` header).

Shutdown: SIGTERM and SIGINT stop the HTTP server and the generation thread the way mlx-lm stops on Ctrl-C, then
the pending write-behinds are flushed for at most ``--flush-timeout`` seconds; what is not written by then is
abandoned (after SIGKILL as well the store is consistent: orphans only, ``kvshelf gc`` reclaims them).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import mlx_lm.server as mlx_server  # this module is the serving entry point: no mlx-lm, no `kvshelf serve`

from ...errors import KvShelfError
from ...store import open_store, read_key_file
from . import startup, warm
from .admin_gate import AdminGate
from .cache_control import CacheBreakpoints, store_clock
from .http_routes import current_request_context, handler_class, set_current_context
from .request_context import DEFAULT_CONTEXT, ApiKeys, RequestContexts, read_secret_file
from .metrics import ServeMetrics
from .prefix_checkpoints import needs_prefix_checkpoints, split_segments
from .model_identity import model_identity
from .prompt_cache import TieredPromptCache
from .hit_policy import DEFAULT_MIN_HIT_TOKENS
from .warm_pins import WarmPinLedger
from .model_names import ServedModelNames
from .ram_tier import DEFAULT_FRACTION, BoundedRam, default_prompt_cache_bytes
from ..upstream import response_generator_base, run_http_server
from .listening import reporting_server_class
from .loaded_model import settle_arrays
from .startup import StartupError
from .status_page import status
from .generations import ServeGenerations, generation_checkpoint_every_arg  # generation checkpoints (RESUMING.md)
from .batch_rows import BatchRows
from .checkpointed_batch import batch_generator_class

log = logging.getLogger("kvshelf.serve")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``123``, ``512M``, ``8G`` (binary units, optional trailing ``B``/``iB``) -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1000000, 512M, 8G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    return int(value * _UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: options this parser does not know go to mlx_lm.server, so a prefix must never match
    # here (mlx-lm's --model would otherwise be taken as an abbreviation of --model-id)
    p = argparse.ArgumentParser(prog="kvshelf serve", add_help=False, allow_abbrev=False,
                                description="mlx-lm's OpenAI-compatible server with a persistent, shared prompt "
                                            "cache. Options not listed here go to mlx_lm.server unchanged.")
    p.add_argument("--store", required=True, metavar="DIR", help="kvshelf store directory (shared by servers)")
    p.add_argument("--model-id", default=None, metavar="NAME",
                   help="the model's identity in the store, asserted (default: a content fingerprint of the weight "
                        "files, hashed once and remembered in the store directory); servers giving the same NAME "
                        "share caches, so give it only to identical weights")
    p.add_argument("--max-bytes", type=parse_size, default=None, metavar="N",
                   help="disk budget of the store (e.g. 20G); least recently used prompt caches are evicted")
    p.add_argument("--cache-namespace", default="", metavar="NS",
                   help="store namespace (default: shared, the empty namespace)")
    p.add_argument("--flush-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, wait at most this long for pending writes (default 30)")
    p.add_argument("--write-queue", type=int, default=8, metavar="N",
                   help="write-behinds in flight at most; more are skipped and counted (default 8)")
    p.add_argument("--write-queue-bytes", type=parse_size, default=1 << 30, metavar="N",
                   help="bytes of write-behinds in flight at most (default 1G)")
    p.add_argument("--min-disk-tokens", type=int, default=16, metavar="N",
                   help="take a disk prefix only when it is at least this long (default 16)")
    p.add_argument("--min-hit-tokens", type=int, default=DEFAULT_MIN_HIT_TOKENS, metavar="N",
                   help="a request counts as a hit only when a tier gave at least N prompt tokens, more than the "
                        "chat template's fixed lead-in; shorter is a miss with the store's reason (default "
                        f"{DEFAULT_MIN_HIT_TOKENS})")
    p.add_argument("--prompt-cache-bytes", type=parse_size, default=None, metavar="N",
                   help="bound of the RAM tier (mlx-lm's prompt caches) in bytes, e.g. 8G (binary units): least "
                        "recently used entries leave RAM first (the store keeps them); mlx_lm.server's own option, "
                        "enforced on every insert (default: "
                        f"{int(DEFAULT_FRACTION * 100)}%% of physical memory)")
    p.add_argument("--store-retry", type=float, default=30.0, metavar="SECONDS",
                   help="retry opening a store that failed to open after this long (default 30)")
    p.add_argument("--min-write-tokens", type=int, default=None, metavar="N",
                   help="write a cache behind only when it holds at least N tokens (default: --min-disk-tokens)")
    p.add_argument("--warm-prompts", default=None, metavar="FILE",
                   help='JSON Lines of {"messages": [...]} or {"prompt": "..."}: prefilled into the store (what it '
                        "does not hold yet) before the server listens")
    p.add_argument("--pin-warm", action="store_true", help="pin the warm prompts: the budget never evicts them")
    p.add_argument("--pin-ttl", type=parse_duration, default=None, metavar="DURATION",
                   help="with --pin-warm: a pin lapses this long after the prompt's last use (e.g. 7d; default never)")
    p.add_argument("--max-pinned-bytes", type=parse_size, default=None, metavar="N",
                   help="pins may hold at most this much (default: half of --max-bytes)")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="the shared tier: redis://, rediss://, redis+cluster:// or valkey:// (a fault is a miss)")
    p.add_argument("--remote-prefix", default="kvshelf:", metavar="PREFIX", help="key prefix (default kvshelf:)")
    p.add_argument("--remote-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to the shared tier and redis-py, e.g. keep_local=false, password=..., "
                        "socket_timeout=0.5 (repeatable; JSON values)")
    p.add_argument("--checkpoint-every", type=int, default=1024, metavar="N",
                   help="for models whose caches cannot be cut (hybrid, recurrent, sliding-window): store a "
                        "checkpoint every N prompt tokens, so a prompt diverging inside a cached one reuses the "
                        "nearest before it (default 1024; 0 turns it off)")
    p.add_argument("--kvshelf-log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="kvshelf's own log level (default INFO: one line per request; DEBUG adds the "
                        "write-behinds)")
    # --- tenants and the admin pages (request_context.py, admin_gate.py, docs/SECURITY.md) ---
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="'KEY TENANT [MAX_BYTES]' per line (or JSON): requests need 'Authorization: Bearer KEY' "
                        "and the key's tenant is theirs; tenants never share a cached prefix")
    p.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="/metrics, /kvshelf and the session endpoints need 'Authorization: Bearer TOKEN' "
                        "(without it they answer only on a loopback bind)")
    p.add_argument("--admin-token-file", default=None, metavar="FILE",
                   help="--admin-token read from a file's first line (keeps it out of the process list)")
    p.add_argument("--tenant-max-bytes", type=parse_size, default=None, metavar="N",
                   help="each tenant's disk quota (a tenant over it evicts only its own sessions; pins count against "
                        "it); a MAX_BYTES column in --api-keys overrides it per tenant")
    p.add_argument("--encryption-key-file", default=None, metavar="FILE",
                   help="encrypt chunks at rest (AES-256-GCM, a data key per tenant): 32 raw bytes, 64 hex digits "
                        "or a passphrase; a store written with a key needs it")
    # --- generation checkpoints (generations.py) ---
    p.add_argument("--generation-checkpoint-every", type=generation_checkpoint_every_arg, default=256, metavar="N",
                   help="checkpoint running greedy/seeded requests every N tokens so that a retry after a crash "
                        "resumes (default 256; 0 off)")
    return p


_DURATION = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``15m``, ``2h``, ``7d`` -> seconds (> 0)."""
    t = text.strip().lower()
    unit = t[-1:] if t[-1:] in _DURATION else "s"
    try:
        value = float(t[:-1] if t[-1:] in _DURATION else t) * _DURATION[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90, 30s, 15m, 2h, 7d)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a duration must be > 0, got {text!r}")
    return value


class StoreOpener:
    """``store_for(model_key)`` for the server: one store handle per model identity, opened on first use."""

    def __init__(self, store_dir: str, cli_args: argparse.Namespace, *, max_bytes: int | None, retry: float,
                 remote: str | None = None, remote_prefix: str = "kvshelf:", remote_options: dict | None = None,
                 max_pinned_bytes: int | None = None, model_id: str | None = None,
                 store_options: dict | None = None):
        self.store_dir, self.cli_args, self.max_bytes, self.retry = store_dir, cli_args, max_bytes, retry
        self.model_id = model_id  # --model-id: the default model's asserted identity
        self.remote, self.remote_prefix, self.remote_options = remote, remote_prefix, dict(remote_options or {})
        self.max_pinned_bytes = max_pinned_bytes
        self.store_options = dict(store_options or {})  # tenant quotas, the encryption key (never logged)
        self._by_key: dict[Any, Any] = {}
        self._by_identity: dict[Any, Any] = {}
        self._failed: dict[Any, float] = {}
        self._lock = threading.Lock()

    def identity_for(self, model_key: Any):
        model_path, adapter_path, draft_path = (tuple(model_key) + (None, None, None))[:3]
        a = self.cli_args
        settings = None
        if getattr(a, "kv_bits", None) is not None:
            settings = {"kv_bits": a.kv_bits, "kv_group_size": a.kv_group_size,
                        "quantized_kv_start": a.quantized_kv_start}
        # --model-id names the default model only: another model a request loads is fingerprinted by content.
        asserted = self.model_id if model_path == getattr(a, "model", None) else None
        return model_identity(model_path, adapter_path=adapter_path, draft_model=draft_path,
                              chat_template=getattr(a, "chat_template", None) or None, cache_settings=settings,
                              model_id=asserted, fingerprints=self.store_dir)

    def open_now(self, model_key: Any):
        """Open the store for ``model_key`` or raise ``StartupError`` (the default model, before listening)."""
        with self._lock:
            try:
                return self._open(model_key)
            except Exception as exc:  # noqa: BLE001 - every cause is a start-up failure, said in one line
                raise StartupError(f"--store {self.store_dir}: cannot open the store for model {model_key[0]}: "
                                   f"{type(exc).__name__}: {exc}") from None

    def _open(self, model_key: Any):
        if model_key in self._by_key:
            return self._by_key[model_key]
        identity = self.identity_for(model_key)
        store = self._by_identity.get(identity)
        if store is None:
            store = open_store(self.store_dir, identity=identity, max_bytes=self.max_bytes,
                               max_pending_bytes=1 << 62,  # the tiered cache bounds the queue itself
                               remote=self.remote, remote_prefix=self.remote_prefix,
                               remote_options=self.remote_options or None, clock=store_clock(),
                               **self.store_options)
            store.pins.set_limit(self.max_pinned_bytes)
            self._by_identity[identity] = store
            log.info("kvshelf store %s open for model %s (config %s, tokenizer %s, budget %s%s)",
                     self.store_dir, identity.model_id, identity.config_fingerprint[:12],
                     identity.tokenizer_hash[:12], self.max_bytes if self.max_bytes is not None else "none",
                     f", remote {store.tier.where}" if store.tier is not None else "")
        self._failed.pop(model_key, None)
        self._by_key[model_key] = store
        return store

    def stores(self) -> list:
        with self._lock:
            return list(self._by_identity.values())

    def __call__(self, model_key: Any):
        with self._lock:
            if model_key in self._by_key:
                return self._by_key[model_key]
            failed_at = self._failed.get(model_key)
            if failed_at is not None and time.monotonic() - failed_at < self.retry:
                return None
            try:
                return self._open(model_key)
            except Exception as exc:  # noqa: BLE001 - the server runs on RAM alone until a retry succeeds
                self._failed[model_key] = time.monotonic()
                log.warning("kvshelf store %s unavailable for %s, serving from RAM only (retry in %.0fs): %s: %s",
                            self.store_dir, model_key, self.retry, type(exc).__name__, exc)
                return None

    def close(self) -> None:
        with self._lock:
            stores, self._by_identity, self._by_key = list(self._by_identity.values()), {}, {}
        for store in stores:
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001 - closing at exit; report and go on
                log.warning("kvshelf store close failed: %s: %s", type(exc).__name__, exc)


def store_options(opts: argparse.Namespace) -> dict:
    """``open_store``'s tenant quotas (``--tenant-max-bytes``, the keys file's MAX_BYTES) and encryption key."""
    out: dict[str, Any] = {}
    quotas: dict[str, int] = {}
    if getattr(opts, "tenant_max_bytes", None) is not None:
        quotas["*"] = opts.tenant_max_bytes
    table = getattr(opts, "api_keys_table", None)
    if table is not None:
        quotas.update({t: n for t, n in table.tenants().items() if n is not None})
    if quotas:
        out["tenant_max_bytes"] = quotas
    if getattr(opts, "encryption_key", None) is not None:
        out["key"] = opts.encryption_key
    return out


class _NoStore:
    """``store_for`` when no store may be used (distributed serving): every model key has none."""

    def __call__(self, _model_key: Any):
        return None

    def stores(self) -> list:
        return []

    def close(self) -> None:
        return None


class Serving:
    """What one ``kvshelf serve`` process adds to mlx-lm: the store opener, the tiered prompt cache (around the
    ``LRUPromptCache`` mlx-lm's ``run`` would build), the metrics and the status document."""

    def __init__(self, opts: argparse.Namespace, cli: argparse.Namespace, ram, *, distributed: bool,
                 bind_host: str = "127.0.0.1"):
        self.opts, self.cli = opts, cli
        # the request-context seam: every route builds its tenant/salt/key here (request_context.py)
        self.contexts = RequestContexts(getattr(opts, "api_keys_table", None))
        self.admin = AdminGate(getattr(opts, "admin_token_value", None), bind_host)
        if distributed:  # every rank holds its own shard of the KV heads: one identity cannot name them; RAM only
            log.warning("kvshelf serve: distributed serving keeps prompt caches in RAM only (no disk tier)")
            self.opener = _NoStore()
        else:
            self.opener = StoreOpener(opts.store, cli, max_bytes=opts.max_bytes, retry=opts.store_retry,
                                      remote=opts.remote, remote_prefix=opts.remote_prefix,
                                      remote_options=opts.remote_options, max_pinned_bytes=opts.max_pinned_bytes,
                                      model_id=opts.model_id, store_options=store_options(opts))
        self.metrics = ServeMetrics(self.state)
        min_write = opts.min_write_tokens if opts.min_write_tokens is not None else opts.min_disk_tokens
        self.tiered = TieredPromptCache(ram, store_for=self.opener, namespace=opts.cache_namespace,
                                        queue_entries=opts.write_queue, queue_bytes=opts.write_queue_bytes,
                                        min_disk_tokens=opts.min_disk_tokens, min_write_tokens=min_write,
                                        observer=self.metrics, min_hit_tokens=opts.min_hit_tokens)

        self.model_names = ServedModelNames(cli.model)  # what /v1/models lists and requests may name
        self.ram = ram  # the RAM tier (ram_tier.BoundedRam): its bytes and evictions are read at scrape time
        self.breakpoints = CacheBreakpoints(self.tiered.queue, self.opener, opts.cache_namespace)  # cache_control (cache_control.py)
        self._prefix_checkpoints_for: dict[int, int] = {}
        # generation checkpoints (generations.py) and the batch rows they take (batch_rows.py)
        # rows of one batch reach a checkpoint in the same step: one write in flight per row, not a fixed 4
        self.generations = ServeGenerations(int(getattr(opts, "generation_checkpoint_every", 0) or 0), self.opener,
                                            max_in_flight=max(4, int(getattr(cli, "decode_concurrency", 0) or 0)))
        self.batch_rows = BatchRows(self.generations)
        self.generation_counters: dict[str, int] = self.generations.counters  # read by /metrics at scrape time

    def prefix_checkpoint_every(self, model) -> int:
        """``--checkpoint-every`` (prefix checkpoints along a prompt) for this model: 0 when its caches can all be
        cut (checked once per model)."""
        every = int(getattr(self.opts, "checkpoint_every", 0) or 0)
        if every <= 0 or model is None:
            return 0
        if id(model) not in self._prefix_checkpoints_for:
            self._prefix_checkpoints_for[id(model)] = every if needs_prefix_checkpoints(model) else 0
        return self._prefix_checkpoints_for[id(model)]

    def state(self) -> dict[str, Any]:
        return {"stores": self.opener.stores(), "pending_writes": self.tiered.pending_writes,
                "pending_bytes": self.tiered.pending_bytes, "queue_entries": self.tiered.queue_entries,
                "queue_counts": self.tiered.queue.counts(),
                "generations": dict(self.generation_counters),
                "ram": self.ram.figures() if hasattr(self.ram, "figures") else None}

    def status(self) -> dict[str, Any]:
        from ...store.remote import redact

        return status(self.metrics, self.state(), model=self.cli.model, store_dir=self.opts.store,
                      remote=redact(self.opts.remote) if self.opts.remote else None)


def _generator_class(serving_of: dict) -> type:
    class KvShelfResponseGenerator(response_generator_base()):
        """mlx-lm's ResponseGenerator, handed the TieredPromptCache around the LRUPromptCache ``run()`` built."""

        def __init__(self, model_provider, prompt_cache):
            self.kvshelf = serving_of["serving"]
            # generation checkpoints (generations.py): set before mlx-lm's constructor starts its thread
            self.generations = self.kvshelf.generations
            super().__init__(model_provider, self.kvshelf.tiered)

        def generate(self, request, generation_args, progress_callback=None):
            # the handler's request context travels with the request to the generation thread (tokenize_request)
            request.kvshelf_context = current_request_context()
            set_current_context(None)
            ctx, response = super().generate(request, generation_args, progress_callback)
            set_current_context(ctx)  # the handler's thread: its X-Kvshelf-Prefix header names this request's fetch
            return ctx, response

        def tokenize_request(self, tokenizer, request, args):  # --checkpoint-every (serve/prefix_checkpoints.py)
            prompt, segments, types, *rest = super().tokenize_request(tokenizer, request, args)
            # the fetch that follows on this thread is this request's: key it by its tenant scope in every tier
            self.kvshelf.tiered.announce_scope(getattr(request, "kvshelf_context", DEFAULT_CONTEXT).scope)
            every = self.kvshelf.prefix_checkpoint_every(self.model_provider.model)
            if every:
                segments, types = split_segments(segments, types, every)
            segments, types = self.kvshelf.breakpoints.split(  # cache_control breakpoints end segments too
                tokenizer, request, prompt, segments, types, self.model_provider.cli_args.chat_template_args)
            # its batch insert, if one follows on this thread, may be a checkpointed row (batch_rows.py)
            self.kvshelf.batch_rows.announce(request, args, prompt, self.model_provider)
            return (prompt, segments, types, *rest)

        def log_cache_stats(self):  # mlx-lm logs 1 + one per cache type at INFO per request: one line is ours
            if log.isEnabledFor(logging.DEBUG):
                super().log_cache_stats()

        # --- generation checkpoints (generations.py): resumable requests are checkpointed rows of mlx-lm's batch
        # (batch_rows.py), seeded ones included (each samples from its own key); served one at a time only where
        # mlx-lm cannot batch (a model whose caches do not merge, --kv-bits) ---
        def is_batchable(self, args):
            taken = self.generations.takes(args)  # counts the requests that are not resumable
            if taken and self.generations.batches(self.model_provider):
                return True
            return super().is_batchable(args) and not taken

        def serve_single(self, request, stream):
            if not self.generations.serve(request, stream, provider=self.model_provider,
                                          tokenize=self.tokenize_request, state_machine=self.make_state_machine,
                                          prompt_cache=self.prompt_cache):
                super().serve_single(request, stream)

    return KvShelfResponseGenerator


def _run_function(opts: argparse.Namespace, made: list):
    """A replacement for ``mlx_lm.server.run``: the same steps, with the model loaded, the store opened and the
    warm prompts prefilled before the HTTP server listens (each failure a ``StartupError``)."""

    def run(host, port, model_provider, server_class=mlx_server.ThreadingHTTPServer,
            handler_class_=mlx_server.APIHandler):
        group = mlx_server.mx.distributed.init()
        cli = model_provider.cli_args
        if cli.model is not None:
            try:
                model_provider.load_default()
            except Exception as exc:  # noqa: BLE001 - whatever mlx-lm raised, the operator reads one line
                raise StartupError(f"--model {cli.model}: the model does not load: {type(exc).__name__}: "
                                   f"{exc}") from None
            # loaded in this thread, served from mlx-lm's: no array may stay bound to this thread's stream
            settle_arrays(model_provider.model)
            settle_arrays(model_provider.draft_model)
        # --prompt-cache-bytes bounds the RAM tier on every insert (ram_tier.py), not only while a batch runs
        ram = BoundedRam(mlx_server.LRUPromptCache(cli.prompt_cache_size, max_bytes=cli.prompt_cache_bytes),
                         cli.prompt_cache_bytes)
        serving = Serving(opts, cli, ram, distributed=model_provider.is_distributed, bind_host=host)
        mlx_server.BatchGenerator = batch_generator_class(serving.batch_rows)  # main() puts mlx-lm's back
        warning = serving.admin.startup_warning()
        if warning:
            log.warning("%s", warning)
        made.append(serving.tiered)
        if cli.model is not None and not model_provider.is_distributed:
            store = serving.opener.open_now((cli.model, cli.adapter_path, cli.draft_model))
            if opts.warm_prompts is not None:
                _warm(opts, cli, model_provider, store)
        generator = _generator_class({"serving": serving})(model_provider, ram)
        made.append(generator)
        if group.rank() == 0:
            run_http_server(host, port, generator, server_class=reporting_server_class(server_class),
                            handler_class=handler_class(handler_class_, serving))
        else:
            generator.join()

    return run


def _warm(opts: argparse.Namespace, cli: argparse.Namespace, model_provider, store) -> None:
    try:
        items = warm.read_warm_prompts(opts.warm_prompts)
    except KvShelfError as exc:
        raise StartupError(f"--warm-prompts: {exc}") from None
    model = model_provider.model
    warm.warm(model, model_provider.tokenizer, store, items, namespace=opts.cache_namespace, pin=opts.pin_warm,
              pin_ttl=opts.pin_ttl, chat_template_args=getattr(cli, "chat_template_args", None) or {},
              prefill_step=getattr(cli, "prefill_step_size", 2048) or 2048,
              ledger=WarmPinLedger(opts.store) if opts.pin_warm else None)  # never re-pin an operator's unpin


def _check_before_start(opts: argparse.Namespace, rest: list[str]) -> None:
    """The cheap checks, before mlx-lm parses its options or loads anything (``startup.py``)."""
    opts.remote_options = startup.parse_remote_options(opts.remote_option)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default=None)
    model = pre.parse_known_args(rest)[0].model
    if model is not None:
        startup.check_model_dir(model)
    startup.check_store_dir(opts.store)
    startup.check_remote(opts.remote, opts.remote_prefix, opts.remote_options)
    if opts.warm_prompts is not None:
        try:
            warm.read_warm_prompts(opts.warm_prompts)
        except KvShelfError as exc:
            raise StartupError(f"--warm-prompts: {exc}") from None
        if model is None:
            raise StartupError("--warm-prompts needs --model (the prompts are prefilled with the default model)")
    if opts.admin_token is not None and opts.admin_token_file is not None:
        raise StartupError("give --admin-token or --admin-token-file, not both")
    try:
        opts.admin_token_value = (read_secret_file(opts.admin_token_file, "--admin-token-file")
                                  if opts.admin_token_file is not None else opts.admin_token)
        opts.api_keys_table = ApiKeys.read(opts.api_keys, parse_size) if opts.api_keys is not None else None
        opts.encryption_key = (read_key_file(opts.encryption_key_file)
                               if opts.encryption_key_file is not None else None)
    except KvShelfError as exc:
        raise StartupError(str(exc)) from None
    if opts.pin_ttl is not None and not opts.pin_warm:
        raise StartupError("--pin-ttl applies to --pin-warm: give both or neither")


def _fail_start(exc: BaseException) -> None:
    print(f"kvshelf serve: cannot start: {exc}", file=sys.stderr, flush=True)


def _install_signals() -> None:
    """SIGTERM behaves as Ctrl-C does for mlx-lm (KeyboardInterrupt in the main thread); a second signal of
    either kind ends the process at once."""

    def first(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        log.info("kvshelf serve: signal %d, stopping", signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, first)
    signal.signal(signal.SIGINT, first)


def _stop_generators(made: list) -> None:
    for generator in made:
        if not isinstance(generator, TieredPromptCache):
            generator.stop_and_join()


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvshelf serve``; ``argv`` are its arguments (ours and mlx_lm.server's, in any order). Does not return
    once the server ran: the process exits 0 when every pending write was flushed, 1 when some were abandoned or
    the server failed (e.g. its port was taken)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "-h" in argv or "--help" in argv:  # ours, then mlx_lm.server's own help (it exits)
        parser.print_help()
        print("\nmlx_lm.server options (all accepted):\n", flush=True)
        sys.argv = ["kvshelf serve", "--help"]
        mlx_server.main()
        return 0
    opts, rest = parser.parse_known_args(argv)
    if opts.prompt_cache_bytes is None:
        opts.prompt_cache_bytes = default_prompt_cache_bytes()
    rest = [*rest, "--prompt-cache-bytes", str(opts.prompt_cache_bytes)]  # mlx-lm's batch trim uses it as well
    try:
        _check_before_start(opts, rest)
    except StartupError as exc:
        _fail_start(exc)
        return 1
    logging.getLogger("kvshelf.serve").setLevel(getattr(logging, opts.kvshelf_log_level))
    made: list = []  # the TieredPromptCache, then the generator that owns it
    original, original_batch = mlx_server.run, mlx_server.BatchGenerator
    mlx_server.run = _run_function(opts, made)
    _install_signals()
    saved_argv = sys.argv
    sys.argv = ["kvshelf serve", *rest]
    failed = False
    try:
        mlx_server.main()
    except KeyboardInterrupt:
        pass
    except StartupError as exc:  # before listening: one clear line, exit 1
        _fail_start(exc)
        log.error("kvshelf serve: cannot start: %s", exc)
        failed = True
        _stop_generators(made)
    except Exception:  # e.g. the port is taken: mlx-lm would leave its generation thread running (a hung process)
        log.exception("kvshelf serve: the server failed")
        failed = True
        _stop_generators(made)
    finally:
        sys.argv = saved_argv
        mlx_server.run = original
        mlx_server.BatchGenerator = original_batch
    caches = [c for c in made if isinstance(c, TieredPromptCache)]
    flushed = all([cache.close(timeout=opts.flush_timeout) for cache in caches])  # noqa: C419 - close every one
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter finalization: MLX aborts there ("terminate called without an active exception",
    # plain mlx_lm.server does the same on Ctrl-C), and writer threads past the deadline must not hold us up.
    os._exit(0 if flushed and not failed else 1)


__all__ = ["Serving", "StoreOpener", "build_parser", "main", "parse_duration", "parse_size"]
