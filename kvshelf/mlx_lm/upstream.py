"""Every private mlx-lm name kvshelf uses, in one place, each with why we need it.

Why one module: mlx-lm does not promise anything about names that start with ``_``; a release may rename or drop
one (``mlx_lm.server._image_parts`` is missing from 0.32.0, so the pin starts at 0.32.1). Here each such name is
reached once, behind a kvshelf name, and ``PRIVATE_NAMES`` lists them with the signature or shape kvshelf relies on;
the tests check that list against the installed mlx-lm and against the lowest and highest mlx-lm the pin allows
(parsing their sources), so a release that breaks one fails a test naming it instead of a request at run time.

Nothing else in ``kvshelf`` touches an ``mlx_lm`` name that starts with ``_``. ``mlx_lm.server`` is imported lazily
(only ``kvshelf serve`` needs it; the codecs need only ``mlx_lm.models.cache``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrivateName:
    """One private mlx-lm name: ``module`` (a dotted module of the mlx_lm package), ``owner`` (its class, or None
    for a module function), ``name``, ``kind`` (``function``, ``method`` or ``attribute``), ``params`` (the leading
    parameter names kvshelf passes, for functions and methods) and ``why`` (what kvshelf uses it for)."""

    module: str
    owner: str | None
    name: str
    kind: str
    params: tuple[str, ...]
    why: str

    @property
    def qualname(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.name) if p)


_SERVER, _CACHE = "mlx_lm.server", "mlx_lm.models.cache"

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(_SERVER, None, "_image_parts", "function", ("messages",),
                "a request with images is left to mlx-lm: its prompt has image placeholders, no continuation key"),
    PrivateName(_SERVER, None, "_make_sampler", "function", ("args", "tokenizer"),
                "a resumable request samples exactly as mlx-lm would (same sampler from the same arguments)"),
    PrivateName(_SERVER, None, "_make_logits_processors", "function", ("args",),
                "a resumable request applies mlx-lm's own penalties and logit bias"),
    PrivateName(_SERVER, None, "_run_http_server", "function",
                ("host", "port", "response_generator", "server_class", "handler_class"),
                "kvshelf serve replaces mlx-lm's run() (to load, open the store and warm before listening) and "
                "hands mlx-lm's HTTP loop its own handler and server class"),
    PrivateName(_SERVER, "ResponseGenerator", "_tokenize", "method", ("self", "tokenizer", "request", "args"),
                "--checkpoint-every (prefix checkpoints) splits mlx-lm's prompt segments further; resumable "
                "requests are tokenized by it (returns prompt, segments, segment types, initial state, ...)"),
    PrivateName(_SERVER, "ResponseGenerator", "_log_cache_stats", "method", ("self",),
                "mlx-lm logs several INFO lines per request; kvshelf logs one and keeps mlx-lm's at DEBUG"),
    PrivateName(_SERVER, "ResponseGenerator", "_is_batchable", "method", ("self", "args"),
                "resumable requests join mlx-lm's batch (seeded ones too: their rows sample from their own key); "
                "where mlx-lm cannot batch they are kvshelf's, one at a time"),
    PrivateName(_SERVER, "ResponseGenerator", "_serve_single", "method", ("self", "request", "stream"),
                "where mlx-lm serves one at a time (caches it cannot batch, --kv-bits), resumable requests are served "
                "by kvshelf's decode loop with generation checkpoints"),
    PrivateName(_SERVER, "ResponseGenerator", "_make_state_machine", "method",
                ("self", "model_key", "tokenizer", "stop_words"),
                "a resumable request stops on the same stop sequences and tool/thinking states as mlx-lm's"),
    PrivateName(_SERVER, "GenerationContext", "_should_stop", "attribute", (),
                "the client went away: the decode loop stops (and keeps the generation checkpoints)"),
    PrivateName(_SERVER, "APIHandler", "_set_completion_headers", "method", ("self", "status_code"),
                "POST /v1/messages answers with mlx-lm's JSON status line, content type and CORS headers"),
    PrivateName(_SERVER, "APIHandler", "_set_stream_headers", "method", ("self", "status_code"),
                "POST /v1/messages streams with mlx-lm's SSE content type, no-cache and CORS headers"),
    PrivateName(_CACHE, "RotatingKVCache", "_idx", "attribute", (),
                "the ring's write position: the codec saves and restores it with the buffers"),
    PrivateName(_CACHE, "BatchKVCache", "_idx", "attribute", (),
                "the batch's filled width: a batch adopted from stored rows sets it to the rows' width"),
    PrivateName(_CACHE, "BatchKVCache", "_right_padding", "attribute", (),
                "a batch cache inside a right-padded prefill cannot be saved yet (set until finalize())"),
    PrivateName(_CACHE, "BatchRotatingKVCache", "_lengths", "attribute", (),
                "as _right_padding, for the rotating batch cache"),
)


# ---------------------------------------------------------------------------------------------- mlx_lm.server
def image_parts(messages: Any):
    """The image parts of a chat request's messages (``mlx_lm.server._image_parts``)."""
    from mlx_lm.server import _image_parts

    return _image_parts(messages)


def make_sampler(args: Any, tokenizer: Any):
    """mlx-lm's sampler for a request's generation arguments (``mlx_lm.server._make_sampler``)."""
    from mlx_lm.server import _make_sampler

    return _make_sampler(args, tokenizer)


def make_logits_processors(args: Any):
    """mlx-lm's logits processors for a request (``mlx_lm.server._make_logits_processors``)."""
    from mlx_lm.server import _make_logits_processors

    return _make_logits_processors(args)


def run_http_server(host: str, port: int, generator: Any, *, server_class: type, handler_class: type) -> None:
    """mlx-lm's HTTP serving loop (``mlx_lm.server._run_http_server``); returns when it stops."""
    from mlx_lm.server import _run_http_server

    _run_http_server(host, port, generator, server_class=server_class, handler_class=handler_class)


def completion_headers(handler: Any, status: int) -> None:
    """mlx-lm's JSON response headers on ``handler`` (``APIHandler._set_completion_headers``; CORS included)."""
    handler._set_completion_headers(status)


def stream_headers(handler: Any, status: int) -> None:
    """mlx-lm's SSE response headers on ``handler`` (``APIHandler._set_stream_headers``; CORS included)."""
    handler._set_stream_headers(status)


def should_stop(ctx: Any) -> bool:
    """Whether the request of a generation context was cancelled (``GenerationContext._should_stop``)."""
    return bool(ctx._should_stop)


@functools.cache
def response_generator_base() -> type:
    """mlx-lm's ``ResponseGenerator`` with the private methods kvshelf overrides or calls given public names.

    A subclass overrides ``tokenize_request``, ``log_cache_stats``, ``is_batchable`` and ``serve_single`` (and
    calls ``super()`` for mlx-lm's behaviour) and calls ``make_state_machine``; mlx-lm's own loop still calls its
    private names, which lead here."""
    from mlx_lm.server import ResponseGenerator

    class HookedResponseGenerator(ResponseGenerator):
        def tokenize_request(self, tokenizer, request, args):
            return ResponseGenerator._tokenize(self, tokenizer, request, args)

        def log_cache_stats(self):
            return ResponseGenerator._log_cache_stats(self)

        def is_batchable(self, args):
            return ResponseGenerator._is_batchable(self, args)

        def serve_single(self, request, stream):
            return ResponseGenerator._serve_single(self, request, stream)

        def make_state_machine(self, model_key, tokenizer, stop_words):
            return self._make_state_machine(model_key, tokenizer, stop_words)

        # mlx-lm's loop calls these: they lead to the public names above (and a subclass's overrides)
        def _tokenize(self, tokenizer, request, args):
            return self.tokenize_request(tokenizer, request, args)

        def _log_cache_stats(self):
            return self.log_cache_stats()

        def _is_batchable(self, args):
            return self.is_batchable(args)

        def _serve_single(self, request, stream):
            return self.serve_single(request, stream)

    return HookedResponseGenerator


# ---------------------------------------------------------------------------------------------- mlx_lm.models.cache
def write_index(cache: Any) -> Any:
    """A ``RotatingKVCache``'s ring write position (``_idx``)."""
    return cache._idx


def set_write_index(cache: Any, index: int) -> None:
    """Set the write position (``_idx``) of a restored ``RotatingKVCache`` (its ring) or of a ``BatchKVCache``
    adopted from stored rows (its filled width)."""
    cache._idx = index


def in_right_padded_prefill(batch: Any) -> bool:
    """Whether a ``BatchKVCache`` (``_right_padding``) or ``BatchRotatingKVCache`` (``_lengths``) is inside a
    right-padded prefill (until ``finalize()``): its rows are not complete yet."""
    return getattr(batch, "_right_padding", None) is not None or getattr(batch, "_lengths", None) is not None


__all__ = ["PRIVATE_NAMES", "PrivateName", "completion_headers", "image_parts", "in_right_padded_prefill", "make_logits_processors",
           "make_sampler", "response_generator_base", "run_http_server", "set_write_index", "should_stop",
           "stream_headers",
           "write_index"]
