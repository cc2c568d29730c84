"""``kvshelf serve``: mlx-lm's OpenAI-compatible server, unchanged, with a persistent and shared prefix cache.

Why: mlx-lm's server keeps its prompt caches in RAM (``LRUPromptCache``); a restart loses every conversation and
two processes share nothing. This module runs ``mlx_lm.server.main`` itself (every option, the HTTP handler,
batching, logging set-up) and changes one thing.

The injection point: ``mlx_lm.server.run()`` builds ``LRUPromptCache(prompt_cache_size)`` and hands it to
``ResponseGenerator(model_provider, prompt_cache)``; the generation thread then only calls the prompt cache's
``fetch_nearest_cache`` / ``insert_cache`` / ``trim_to`` / ``nbytes`` / ``len`` / ``stats_by_type``. While
``main`` runs, the module attribute ``mlx_lm.server.ResponseGenerator`` is a subclass whose constructor wraps that
very ``LRUPromptCache`` (kept as the RAM tier) in a :class:`TieredPromptCache` and passes it on. Nothing else of
mlx-lm is replaced; besides the wrapping, the subclass only routes resumable requests (greedy or seeded) to
``generations.ServeGenerations``, which checkpoints them and resumes their retries (docs/RESUMING.md).

Stores: one handle per model identity (``model_identity``: path or repo, config.json and safetensors headers,
tokenizer files, KV settings), opened for the default model before the HTTP server starts and lazily for models a
request names. A store that cannot be opened (busy, damaged, missing permissions) leaves the server on RAM only
and is retried every ``--store-retry`` seconds. Several servers may share one store directory.

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

from ...store import open_store
from .model_identity import model_identity
from .prompt_cache import TieredPromptCache
from .generations import ServeGenerations, checkpoint_every_arg  # generation checkpoints (RESUMING.md)

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
    p = argparse.ArgumentParser(prog="kvshelf serve", add_help=False,
                                description="mlx-lm's OpenAI-compatible server with a persistent, shared prompt "
                                            "cache. Options not listed here go to mlx_lm.server unchanged.")
    p.add_argument("--store", required=True, metavar="DIR", help="kvshelf store directory (shared by servers)")
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
    p.add_argument("--store-retry", type=float, default=30.0, metavar="SECONDS",
                   help="retry opening a store that failed to open after this long (default 30)")
    # --- generation checkpoints (generations.py) ---
    p.add_argument("--generation-checkpoint-every", type=checkpoint_every_arg, default=256, metavar="N",
                   help="checkpoint running greedy/seeded requests every N tokens so that a retry after a crash "
                        "resumes (default 256; 0 off)")
    return p


class StoreOpener:
    """``store_for(model_key)`` for the server: one store handle per model identity, opened on first use."""

    def __init__(self, store_dir: str, cli_args: argparse.Namespace, *, max_bytes: int | None, retry: float):
        self.store_dir, self.cli_args, self.max_bytes, self.retry = store_dir, cli_args, max_bytes, retry
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
        return model_identity(model_path, adapter_path=adapter_path, draft_model=draft_path,
                              chat_template=getattr(a, "chat_template", None) or None, cache_settings=settings)

    def __call__(self, model_key: Any):
        with self._lock:
            if model_key in self._by_key:
                return self._by_key[model_key]
            failed_at = self._failed.get(model_key)
            if failed_at is not None and time.monotonic() - failed_at < self.retry:
                return None
            try:
                identity = self.identity_for(model_key)
                store = self._by_identity.get(identity)
                if store is None:
                    store = open_store(self.store_dir, identity=identity, max_bytes=self.max_bytes,
                                       max_pending_bytes=1 << 62)  # the tiered cache bounds the queue itself
                    self._by_identity[identity] = store
                    log.info("kvshelf store %s open for model %s (config %s, tokenizer %s, budget %s)",
                             self.store_dir, identity.model_id, identity.config_fingerprint[:12],
                             identity.tokenizer_hash[:12], self.max_bytes if self.max_bytes is not None else "none")
            except Exception as exc:  # noqa: BLE001 - the server runs on RAM alone until a retry succeeds
                self._failed[model_key] = time.monotonic()
                log.warning("kvshelf store %s unavailable for %s, serving from RAM only (retry in %.0fs): %s: %s",
                            self.store_dir, model_key, self.retry, type(exc).__name__, exc)
                return None
            self._failed.pop(model_key, None)
            self._by_key[model_key] = store
            return store

    def close(self) -> None:
        with self._lock:
            stores, self._by_identity, self._by_key = list(self._by_identity.values()), {}, {}
        for store in stores:
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001 - closing at exit; report and go on
                log.warning("kvshelf store close failed: %s: %s", type(exc).__name__, exc)


class _NoStore:
    """``store_for`` when no store may be used (distributed serving): every model key has none."""

    def __call__(self, _model_key: Any):
        return None

    def close(self) -> None:
        return None


def _generator_class(base: type, opts: argparse.Namespace, made: list) -> type:
    class KvShelfResponseGenerator(base):
        """mlx-lm's ResponseGenerator, handed a TieredPromptCache around the LRUPromptCache ``run()`` built."""

        def __init__(self, model_provider, prompt_cache):
            cli = model_provider.cli_args
            opener = StoreOpener(opts.store, cli, max_bytes=opts.max_bytes, retry=opts.store_retry)
            if getattr(model_provider, "is_distributed", False):
                # every rank holds its own shard of the KV heads: one identity cannot name them; RAM only
                log.warning("kvshelf serve: distributed serving keeps prompt caches in RAM only (no disk tier)")
                opener = _NoStore()
            tiered = TieredPromptCache(prompt_cache, store_for=opener, namespace=opts.cache_namespace,
                                       queue_entries=opts.write_queue, queue_bytes=opts.write_queue_bytes,
                                       min_disk_tokens=opts.min_disk_tokens)
            made.append(tiered)
            # --- generation checkpoints (generations.py): set before mlx-lm's constructor starts its thread ---
            self.generations = ServeGenerations(opts.generation_checkpoint_every, opener)
            if cli.model is not None:  # open before the first request, so a slow open is not a slow request
                opener((cli.model, cli.adapter_path, cli.draft_model))
            super().__init__(model_provider, tiered)
            made.append(self)

        # --- generation checkpoints (generations.py): resumable requests are served by us, one at a time ---
        def _is_batchable(self, args):
            taken = self.generations.takes(args)  # counts the requests that are not resumable
            return super()._is_batchable(args) and not taken

        def _serve_single(self, request, stream):
            if not self.generations.serve(request, stream, provider=self.model_provider, tokenize=self._tokenize,
                                          state_machine=self._make_state_machine, prompt_cache=self.prompt_cache):
                super()._serve_single(request, stream)

    return KvShelfResponseGenerator


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
    made: list = []  # the TieredPromptCache, then the generator that owns it
    original = mlx_server.ResponseGenerator
    mlx_server.ResponseGenerator = _generator_class(original, opts, made)
    _install_signals()
    saved_argv = sys.argv
    sys.argv = ["kvshelf serve", *rest]
    failed = False
    try:
        mlx_server.main()
    except KeyboardInterrupt:
        pass
    except Exception:  # e.g. the port is taken: mlx-lm would leave its generation thread running (a hung process)
        log.exception("kvshelf serve: the server failed")
        failed = True
        for generator in made:
            if not isinstance(generator, TieredPromptCache):
                generator.stop_and_join()
    finally:
        sys.argv = saved_argv
        mlx_server.ResponseGenerator = original
    caches = [c for c in made if isinstance(c, TieredPromptCache)]
    flushed = all([cache.close(timeout=opts.flush_timeout) for cache in caches])  # noqa: C419 - close every one
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter finalization: MLX aborts there ("terminate called without an active exception",
    # plain mlx_lm.server does the same on Ctrl-C), and writer threads past the deadline must not hold us up.
    os._exit(0 if flushed and not failed else 1)


__all__ = ["StoreOpener", "build_parser", "main", "parse_size"]
