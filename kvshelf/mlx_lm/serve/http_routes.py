"""kvshelf's HTTP additions to mlx-lm's own request handler: ``GET /metrics``, ``GET /kvshelf``,
``GET /kvshelf/stats`` and the ``X-Kvshelf-Prefix`` response header.

Why a subclass of mlx-lm's ``APIHandler`` and nothing more: every OpenAI route, header, CORS rule and streaming
detail stays mlx-lm's. Three GET paths are answered here, every other request goes to mlx-lm unchanged. The header
needs to know which fetch was this request's: the generator hands the request's generation context (its prompt
tokens) to the handler thread (``current_context``), and ``end_headers`` (which every mlx-lm response calls once)
asks the prompt cache for the fetch outcome of that prompt. A non-streaming response ends its headers after the
generation, so the outcome is there; a streaming one may end them just before the fetch, so it waits for it.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from typing import Any

from .anthropic_messages import serve_messages
from .anthropic_translate import ROUTE as MESSAGES_ROUTE
from .anthropic_translate import MessagesRejected
from .metrics import CONTENT_TYPE
from .request_context import DEFAULT_CONTEXT, RequestContext, RequestRejected
from .session_routes import SessionRoutes, claims as session_path
from .status_page import render

HEADER = "X-Kvshelf-Prefix"
STREAM_WAIT = 30.0  # seconds a streaming response's headers wait for the fetch (it precedes the first token anyway)
_current = threading.local()


def set_current_context(ctx: Any) -> None:
    """Called in the handler's thread by the generator's ``generate``: this request's generation context."""
    _current.ctx = ctx


def current_request_context() -> RequestContext:
    """The tenant/salt/key context of the request this handler thread is serving (``request_context.py``)."""
    return getattr(_current, "request_context", None) or DEFAULT_CONTEXT


ADMIN_PATHS = ("/metrics", "/kvshelf", "/kvshelf/stats")


def handler_class(base: type, serving: Any) -> type:
    """mlx-lm's ``APIHandler`` subclass for ``serving`` (a ``server.Serving``: metrics, status, prompt cache)."""

    sessions = SessionRoutes(serving)  # /kvshelf/sessions: sessions as files (session_routes.py)

    class KvShelfHandler(base):
        def do_GET(self):  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            if session_path(path):
                sessions.answer(self, "GET", super().end_headers)
                return
            if path in ADMIN_PATHS:
                try:
                    serving.admin.check(self.headers)
                except RequestRejected as exc:
                    self._reject(exc)
                    return
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE, serving.metrics.exposition())
            elif path == "/kvshelf":
                self._reply(200, "text/html; charset=utf-8", render(serving.status()).encode())
            elif path == "/kvshelf/stats":
                self._reply(200, "application/json", json.dumps(serving.status()).encode())
            elif path == "/v1/models" or path.startswith("/v1/models/"):  # the served model's name (model_names.py)
                self._models(path)
            else:
                super().do_GET()

        def do_POST(self):  # noqa: N802
            _current.ctx = None  # a keep-alive connection's previous request must not lend its context
            _current.request_context = None
            if session_path(self.path.split("?", 1)[0].rstrip("/")):
                sessions.answer(self, "POST", super().end_headers)
                return
            try:  # authentication and the tenant header before the body is read: a 401 costs no parsing
                _current.request_context = serving.contexts.from_headers(self.headers)
            except RequestRejected as exc:
                self._reject(exc)
                return
            if self.path.split("?", 1)[0] == MESSAGES_ROUTE:  # the Anthropic Messages API (anthropic_messages.py)
                serve_messages(self, serving, self._narrow_by_body)
                return
            super().do_POST()

        def do_DELETE(self):  # noqa: N802
            if session_path(self.path.split("?", 1)[0].rstrip("/")):
                sessions.answer(self, "DELETE", super().end_headers)
            else:
                self.send_error(404)

        def _narrow_by_body(self, body):
            try:
                _current.request_context = serving.contexts.with_body(current_request_context(), body)
            except RequestRejected as exc:
                raise MessagesRejected(exc.message) from None

        def validate_model_parameters(self):  # mlx-lm calls it once the body is parsed; ValueError -> its 400
            self.requested_model = serving.model_names.resolve(getattr(self, "requested_model", None))
            super().validate_model_parameters()
            try:
                _current.request_context = serving.contexts.with_body(current_request_context(), self.body)
            except RequestRejected as exc:
                raise ValueError(exc.message) from None

        def _reject(self, exc: RequestRejected) -> None:
            body = json.dumps({"error": {"message": exc.message, "type": "invalid_request_error"
                                         if exc.status == 400 else "authentication_error"}}).encode()
            self.close_connection = True  # the body of a rejected POST may be unread
            self.send_response(exc.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if exc.status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            super().end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def end_headers(self):
            if self.command == "POST":
                ctx, _current.ctx = getattr(_current, "ctx", None), None
                if ctx is not None and getattr(ctx, "prompt", None) is not None:
                    wait = STREAM_WAIT if getattr(self, "stream", False) and not _has_images(self) else 0.0
                    outcome = serving.tiered.outcome_for(ctx.prompt, timeout=wait,
                                                         scope=current_request_context().scope)
                    if outcome is not None:
                        self.send_header(HEADER, outcome.header())
                        self.send_header("Access-Control-Expose-Headers", HEADER)
            super().end_headers()

        def _models(self, path: str) -> None:
            if path == "/v1/models":
                self._reply(200, "application/json", json.dumps(serving.model_names.listing()).encode())
                return
            wanted = urllib.parse.unquote(path[len("/v1/models/"):])
            entry = serving.model_names.entry(wanted)
            doc = entry if entry is not None else {"error": {"message": f"no model {wanted!r} is served here (GET "
                                                                        "/v1/models lists it)",
                                                             "type": "invalid_request_error"}}
            self._reply(200 if entry is not None else 404, "application/json", json.dumps(doc).encode())

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            super().end_headers()
            self.wfile.write(body)
            self.wfile.flush()

    return KvShelfHandler


def _has_images(handler: Any) -> bool:
    """A request with images is fetched under another key (mlx-lm's vision cache key): no outcome to wait for."""
    body = getattr(handler, "body", None)
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image_url", "input_image") for p in m["content"])
        for m in messages)


__all__ = ["ADMIN_PATHS", "HEADER", "current_request_context", "handler_class", "set_current_context"]
