"""Sessions as files over HTTP: ``/kvshelf/sessions`` on ``kvshelf serve`` (docs/AGENTS.md, docs/API.md).

- ``GET /kvshelf/sessions``: the request's tenant's sessions (id, tokens, bytes, times), most recently used first.
- ``POST /kvshelf/sessions/{id}/export``: the session as a portable snapshot file (``kvshelf export``'s format).
- ``POST /kvshelf/sessions/import[?session=ID]``: the body is such a file; refused with 409 when it was made under
  another model identity, 422 when it is damaged or no snapshot file; nothing is written unless all of it checks.
- ``POST /kvshelf/sessions/{id}/fork?to=NEW``: a branch sharing every chunk (409 when NEW exists).
- ``DELETE /kvshelf/sessions/{id}``: removes it.

Why these doors: they hand out and take in whole conversations, so each passes the admin gate first
(``serving.admin.check``: the admin token, or loopback only without one) and then acts only in the request's tenant
scope, built by the same seam as every other route (``serving.contexts.from_headers`` and ``with_body`` for a
``cache_salt`` query parameter). When the admin token is set, ``Authorization`` carries it, so a tenant's API key
comes as ``x-api-key`` here; without ``--api-keys`` the ``X-Kvshelf-Tenant`` header names the tenant. A tenant
asking for another tenant's session id gets 404: the other scope is not looked in.

Ids are path segments, percent-decoded once (``a%2Fb`` is the session ``a/b``); a segment that does not decode
to UTF-8 text, is empty, longer than the store allows or holds a control character is a 400.
"""

from __future__ import annotations

import json
import logging
import shutil
import unicodedata
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from ...errors import (CorruptData, IdentityMismatch, IncompatibleFormat, InvalidCacheState, KvShelfError,
                       SnapshotNotFound, StoreBusy, StoreFull, StoreReadOnly)
from . import session_files
from .request_context import RequestRejected

log = logging.getLogger("kvshelf.serve")
PREFIX = "/kvshelf/sessions"
MAX_ID_BYTES = 448  # the store's session id limit
COPY_BLOCK = 1 << 20


def claims(path: str) -> bool:
    """Whether a request path (query stripped) is one of these routes."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, RequestRejected):
        return exc.status
    if isinstance(exc, SnapshotNotFound):
        return 404
    if isinstance(exc, (IdentityMismatch, session_files.SessionExists)):
        return 409
    if isinstance(exc, (CorruptData, IncompatibleFormat)):
        return 422
    if isinstance(exc, StoreFull):
        return 507
    if isinstance(exc, (StoreBusy, StoreReadOnly)):
        return 503
    if isinstance(exc, InvalidCacheState):
        return 400
    return 500


def session_id(segment: str) -> str:
    """A raw path segment as a session id (percent-decoded once), or ``RequestRejected(400)``."""
    try:
        text = unquote(segment, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise RequestRejected(400, "a session id must be percent-encoded UTF-8") from None
    if not text:
        raise RequestRejected(400, "a session id must not be empty")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise RequestRejected(400, f"a session id must be at most {MAX_ID_BYTES} bytes")
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in text):
        raise RequestRejected(400, "a session id must not contain control characters")
    return text


class SessionRoutes:
    """Answers one request on ``/kvshelf/sessions...`` for ``serving`` (a ``server.Serving``)."""

    def __init__(self, serving: Any):
        self.serving = serving

    # ------------------------------------------------------------------ the request's scope
    def _context(self, headers: Any, query: dict[str, list[str]]):
        self.serving.admin.check(headers)
        if self.serving.admin.protected:  # Authorization carried the admin token: the tenant's key is x-api-key
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        ctx = self.serving.contexts.from_headers(_Headers(headers))
        if "cache_salt" in query:
            ctx = self.serving.contexts.with_body(ctx, {"cache_salt": query["cache_salt"][0]})
        return ctx

    def _store(self):
        cli = self.serving.cli
        store = self.serving.opener((cli.model, cli.adapter_path, cli.draft_model))
        if store is None:
            raise StoreBusy("the store is not available now (the server runs on RAM only); try again later")
        return store

    # ------------------------------------------------------------------ dispatch
    def answer(self, handler: Any, method: str, end_headers: Any) -> None:
        """Serve the request ``handler`` holds; ``end_headers`` is http.server's own (no prefix header here)."""
        raw_path, _, raw_query = handler.path.partition("?")
        query = parse_qs(raw_query, keep_blank_values=True)
        parts = raw_path.rstrip("/")[len(PREFIX):].split("/")[1:]
        try:
            ctx = self._context(handler.headers, query)
            namespace = ctx.namespace(self.serving.opts.cache_namespace or "")
            if method == "GET" and not parts:
                self._json(handler, end_headers, 200, {"sessions": session_files.listing(self._store(), namespace)})
            elif method == "POST" and parts == ["import"]:
                wanted = session_id(query["session"][0]) if "session" in query else None
                self._import(handler, end_headers, namespace, wanted)
            elif method == "POST" and len(parts) == 2 and parts[1] == "export":
                self._export(handler, end_headers, namespace, session_id(parts[0]))
            elif method == "POST" and len(parts) == 2 and parts[1] == "fork":
                if "to" not in query:
                    raise RequestRejected(400, "fork needs ?to=NEW_SESSION_ID")
                done = session_files.fork(self._store(), namespace, session_id(parts[0]), session_id(query["to"][0]))
                self._json(handler, end_headers, 201, _imported(done))
            elif method == "DELETE" and len(parts) == 1:
                session_files.delete(self._store(), namespace, session_id(parts[0]))
                self._json(handler, end_headers, 200, {"deleted": session_id(parts[0])})
            else:
                raise RequestRejected(404, f"no such session endpoint: {method} {raw_path}")
        except KvShelfError as exc:
            self._error(handler, end_headers, exc)
        except Exception as exc:  # noqa: BLE001 - a bug or an I/O fault: a 500 naming it, the server stays up
            log.warning("kvshelf sessions %s %s failed: %s: %s", method, raw_path, type(exc).__name__, exc)
            self._error(handler, end_headers, KvShelfError(f"{type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------------ the two file transfers
    def _export(self, handler: Any, end_headers: Any, namespace: str, sid: str) -> None:
        store = self._store()
        self._drain(handler)
        with session_files.scratch_dir() as tmp:
            path = session_files.export_to(store, namespace, sid, tmp)
            size = path.stat().st_size
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Content-Length", str(size))
            handler.send_header("Content-Disposition", 'attachment; filename="session.safetensors"')
            handler.send_header("Cache-Control", "no-store")
            end_headers()
            with open(path, "rb") as f:
                shutil.copyfileobj(f, handler.wfile, COPY_BLOCK)
            handler.wfile.flush()

    def _import(self, handler: Any, end_headers: Any, namespace: str, wanted: str | None) -> None:
        store = self._store()
        length = handler.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            raise RequestRejected(411, "import needs the file as the body, with a Content-Length")
        left = int(length)
        with session_files.scratch_dir() as tmp:
            path = f"{tmp}/upload.safetensors"
            with open(path, "wb") as f:
                while left > 0:
                    block = handler.rfile.read(min(left, COPY_BLOCK))
                    if not block:
                        raise RequestRejected(400, "the body ended before its Content-Length")
                    f.write(block)
                    left -= len(block)
            done = session_files.import_from(store, namespace, Path(path), wanted)
        self._json(handler, end_headers, 201, _imported(done))

    # ------------------------------------------------------------------ replies
    @staticmethod
    def _drain(handler: Any) -> None:
        length = handler.headers.get("Content-Length")
        if length and length.strip().isdigit() and int(length) > 0:
            handler.rfile.read(int(length))

    @staticmethod
    def _json(handler: Any, end_headers: Any, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Cache-Control", "no-store")
        end_headers()
        handler.wfile.write(body)
        handler.wfile.flush()

    def _error(self, handler: Any, end_headers: Any, exc: KvShelfError) -> None:
        status = _status_of(exc)
        message = exc.message if isinstance(exc, RequestRejected) else f"{type(exc).__name__}: {exc}"
        handler.close_connection = True  # an unread body must not be taken for the next request
        body = json.dumps({"error": {"message": message, "type": type(exc).__name__, "status": status}}).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        if status == 401:
            handler.send_header("WWW-Authenticate", "Bearer")
        end_headers()
        handler.wfile.write(body)
        handler.wfile.flush()


class _Headers:
    """A plain mapping with ``get`` read case-insensitively, as ``http.server``'s headers are."""

    def __init__(self, items: Any):
        self._items = {k.lower(): v for k, v in items.items()}

    def get(self, name: str, default: Any = None) -> Any:
        return self._items.get(name.lower(), default)


def _imported(done: session_files.Imported) -> dict[str, Any]:
    return {"session_id": done.session_id, "tokens": done.tokens, "bytes_written": done.bytes_written,
            "bytes_reused": done.bytes_reused}


__all__ = ["PREFIX", "SessionRoutes", "claims", "session_id"]
