"""Who a request is for: its tenant, its cache salt and the API key it came with (the request-context seam).

Why one object: a shared prefix cache is shared with whoever can reach the server, and every response says how much
of its prompt was cached (``cached_tokens``, ``X-Kvshelf-Prefix``, the time to first token), so a client can probe
another's prompts token by token. Isolation has to hold in every tier at once — mlx-lm's RAM ``LRUPromptCache``,
the store, the shared tier, checkpoints and resumable generations — and it only does if each of them keys by the
same thing. ``RequestContext.scope`` is that thing: the tenant and salt folded into the store namespace
(``kvshelf.store.tenant_scope``), the RAM tier's model key and the resumable generations' continuation key. Every
route (OpenAI's, Anthropic's, the session endpoints) builds its context here and nowhere else.

The rules (vLLM's ``cache_salt``, mlx-vlm's tenant header, isolation by default and sharing by opt-in):

- With ``--api-keys FILE`` a request must carry ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``);
  none or an unknown key is a 401. The key's tenant is the request's tenant; an ``X-Kvshelf-Tenant`` header naming
  another tenant is a 403 (a header never widens what a key may see).
- Without keys, ``X-Kvshelf-Tenant`` names the tenant (a trusted proxy in front sets it); no header is the default
  tenant, as before tenants existed.
- ``cache_salt`` in the body (a non-empty string) narrows the tenant further: the same prefix with the same salt
  reuses, another salt never.
- A tenant or salt over 256 bytes, with a control character or not valid UTF-8 is a 400 naming the field; a key
  is never echoed (messages name ``the API key``, logs carry ``key_id``, a digest prefix).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from ...errors import KvShelfError
from ...store import MAX_TENANT_BYTES, tenant_scope, tenant_token

TENANT_HEADER = "X-Kvshelf-Tenant"
SALT_FIELD = "cache_salt"


class RequestRejected(KvShelfError):
    """A request the server answers with ``status`` (400, 401, 403) and ``message`` instead of serving it."""

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message
        super().__init__(message)


@dataclass(frozen=True)
class RequestContext:
    """One request's tenant, salt and (non-secret) key id. ``scope`` keys every tier."""

    tenant: str = ""
    salt: str | None = None
    key_id: str | None = None  # the first 12 hex digits of the key's SHA-256: names the key in logs, reveals nothing

    @property
    def scope(self) -> str:
        """The tenant and salt as a namespace suffix; ``""`` for the default tenant without a salt."""
        return tenant_scope(self.tenant, self.salt)

    def namespace(self, base: str) -> str:
        """The store namespace this request reads and writes under ``base`` (``--cache-namespace``)."""
        return base + self.scope

    @property
    def label(self) -> str:
        """The tenant as logs and admin-only figures show it (long or odd names as their digest token)."""
        return tenant_token(self.tenant) or "default"


DEFAULT_CONTEXT = RequestContext()


@dataclass(frozen=True)
class ApiKey:
    """One line of the keys file: the tenant a key speaks for and that tenant's byte quota (None: no quota)."""

    tenant: str
    max_bytes: int | None = None
    key_id: str = field(default="", compare=False)


class ApiKeys:
    """``--api-keys FILE``: ``KEY TENANT [MAX_BYTES]`` per line (``#`` comments), or a JSON object
    ``{"KEY": "TENANT"}`` / ``{"KEY": {"tenant": T, "max_bytes": N}}``. Keys are kept only as SHA-256 digests, so a
    lookup compares digests (no secret-dependent timing on the key itself) and nothing kept can be logged by
    mistake."""

    def __init__(self, by_digest: dict[bytes, ApiKey]):
        if not by_digest:
            raise KvShelfError("--api-keys: the file names no key")
        self._by_digest = dict(by_digest)

    @classmethod
    def read(cls, path: str, parse_size: Any = int) -> ApiKeys:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise KvShelfError(f"--api-keys {path}: cannot read the keys file: {type(exc).__name__}") from None
        entries: dict[bytes, ApiKey] = {}
        if text.lstrip().startswith("{"):
            try:
                raw = json.loads(text)
            except ValueError as exc:
                raise KvShelfError(f"--api-keys {path}: not valid JSON (line {getattr(exc, 'lineno', '?')})") from None
            items = [(k, v) for k, v in raw.items()]
        else:
            items = []
            for n, line in enumerate(text.splitlines(), start=1):
                parts = line.split("#", 1)[0].split()
                if not parts:
                    continue
                if len(parts) not in (2, 3):
                    raise KvShelfError(f"--api-keys {path}: line {n}: expected 'KEY TENANT [MAX_BYTES]', "
                                       f"got {len(parts)} fields")
                items.append((parts[0], {"tenant": parts[1], "max_bytes": parts[2] if len(parts) == 3 else None}))
        for n, (key, value) in enumerate(items, start=1):
            spec = {"tenant": value} if isinstance(value, str) else value
            if not isinstance(key, str) or not key or not isinstance(spec, dict) or not isinstance(
                    spec.get("tenant"), str):
                raise KvShelfError(f"--api-keys {path}: entry {n}: a key needs a tenant name")
            tenant = spec["tenant"]
            _check_text(tenant, "tenant", where=f"--api-keys {path}: entry {n}: ", status=None)
            quota = spec.get("max_bytes")
            try:
                quota = None if quota is None else int(parse_size(str(quota)))
            except Exception:  # noqa: BLE001 - argparse's or ours: one line naming the entry
                raise KvShelfError(f"--api-keys {path}: entry {n}: max_bytes is not a size") from None
            digest = _digest(key)
            entries[digest] = ApiKey(tenant, quota, key_id=digest.hex()[:12])
        return cls(entries)

    def find(self, presented: str) -> ApiKey | None:
        found = self._by_digest.get(_digest(presented))
        return found

    def tenants(self) -> dict[str, int | None]:
        """Every tenant the file names, with its quota."""
        out: dict[str, int | None] = {}
        for k in self._by_digest.values():
            out[k.tenant] = k.max_bytes if k.max_bytes is not None else out.get(k.tenant)
        return out


class RequestContexts:
    """Builds each request's ``RequestContext`` from its headers and body (the rules in the module docstring)."""

    def __init__(self, api_keys: ApiKeys | None = None):
        self.api_keys = api_keys

    def from_headers(self, headers: Any) -> RequestContext:
        """The context the headers give (authentication, the tenant header); raises ``RequestRejected``."""
        tenant_header = headers.get(TENANT_HEADER)
        tenant = None if tenant_header is None else _header_text(tenant_header, TENANT_HEADER)
        if tenant == "":
            raise RequestRejected(400, f"{TENANT_HEADER} must not be empty")
        if self.api_keys is None:
            return RequestContext(tenant or "")
        presented = _presented_key(headers)
        if presented is None:
            raise RequestRejected(401, "an API key is required: send 'Authorization: Bearer KEY' (or 'x-api-key')")
        key = self.api_keys.find(presented)
        if key is None:
            raise RequestRejected(401, "the API key is not valid")
        if tenant is not None and tenant != key.tenant:
            raise RequestRejected(403, f"{TENANT_HEADER} names another tenant than the API key's")
        return RequestContext(key.tenant, None, key.key_id)

    @staticmethod
    def with_body(ctx: RequestContext, body: Any) -> RequestContext:
        """``ctx`` narrowed by the body's ``cache_salt``; raises ``RequestRejected`` (400) for a bad salt."""
        if not isinstance(body, dict) or SALT_FIELD not in body:
            return ctx
        salt = body[SALT_FIELD]
        if not isinstance(salt, str) or salt == "":
            raise RequestRejected(400, f"{SALT_FIELD} must be a non-empty string")
        _check_text(salt, SALT_FIELD)
        return RequestContext(ctx.tenant, salt, ctx.key_id)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _presented_key(headers: Any) -> str | None:
    auth = headers.get("Authorization")
    if auth is not None:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return ""  # present but not a bearer key: rejected as not valid (never echoed)
    key = headers.get("x-api-key")
    return key.strip() if key is not None else None


def _header_text(value: str, name: str) -> str:
    """http.server decodes header bytes as ISO-8859-1: recover the bytes and require UTF-8."""
    try:
        text = value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise RequestRejected(400, f"{name} must be valid UTF-8") from None
    _check_text(text, name)
    return text.strip()


def _check_text(text: str, name: str, *, where: str = "", status: int | None = 400) -> None:
    problem = None
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raw, problem = b"", "must be valid UTF-8"
    if problem is None and len(raw) > MAX_TENANT_BYTES:
        problem = f"must be at most {MAX_TENANT_BYTES} bytes, got {len(raw)}"
    if problem is None and any(unicodedata.category(c) in ("Cc", "Cs") for c in text):
        problem = "must not contain control characters"
    if problem is not None:
        if status is None:
            raise KvShelfError(f"{where}{name} {problem}")
        raise RequestRejected(status, f"{name} {problem}")


def constant_time_equal(a: str, b: str) -> bool:
    """Compare a presented admin token with the configured one without a secret-dependent early exit."""
    return hmac.compare_digest(_digest(a), _digest(b))


def read_secret_file(path: str, what: str) -> str:
    """A token from a file (first line, stripped); the error names the file, never its content."""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise KvShelfError(f"{what} {path}: cannot read it: {type(exc).__name__}") from None
    if not value:
        raise KvShelfError(f"{what} {path}: the file is empty")
    return value


__all__ = ["ApiKey", "ApiKeys", "DEFAULT_CONTEXT", "RequestContext", "RequestContexts", "RequestRejected",
           "SALT_FIELD", "TENANT_HEADER", "constant_time_equal", "read_secret_file"]
