"""Who a snapshot was made for: the model, its config and its tokenizer.

Reusing KV state across any of these silently gives wrong answers (another model's caches decode to plausible
garbage, not an error), so every key the store derives
(prefix hashes, session keys, LRU order) starts with the identity key, and a store only ever sees its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import xxhash

from .inputs import MAX_TENANT_BYTES, TENANT_MARK, check_identity_field, check_namespace, check_tenant


@dataclass(frozen=True)
class Identity:
    """The model identity a store is opened under. Empty fields are allowed but still part of the key."""

    model_id: str
    config_fingerprint: str = ""
    tokenizer_hash: str = ""

    def __post_init__(self) -> None:
        for name in ("model_id", "config_fingerprint", "tokenizer_hash"):
            check_identity_field(name, getattr(self, name))  # str, <= 1024 UTF-8 bytes, no NUL/lone surrogate

    @property
    def key(self) -> bytes:
        """16 bytes naming this identity in every index key (xxh3-128 of the three fields)."""
        return identity_key(self.model_id, self.config_fingerprint, self.tokenizer_hash)


def identity_key(model_id: str, config_fingerprint: str, tokenizer_hash: str) -> bytes:
    return xxhash.xxh3_128_digest(msgspec.msgpack.encode(["kvshelf-identity-v1", model_id, config_fingerprint,
                                                          tokenizer_hash]))


def namespace_key(identity_key_: bytes, namespace: str) -> bytes:
    """16 bytes naming (identity, namespace): the scope of sessions, prefix records and lookups."""
    return xxhash.xxh3_128_digest(identity_key_ + b"\x00ns\x00" + namespace.encode("utf-8", "surrogatepass"))


__all__ = ["MAX_TENANT_BYTES", "Identity", "base_namespace", "identity_key", "namespace_key", "scoped_namespace",
           "tenant_namespace", "tenant_of", "tenant_scope", "tenant_token"]


# --- tenants: a tenant (and a cache salt) is part of the namespace, so of every key in every tier -------------------
#
# Why in the namespace: every key the store derives (session keys, prefix records, LRU order, the shared tier's keys
# through ``namespace_key``) already starts with the (identity, namespace) pair, so a tenant folded into the namespace
# is part of the key everywhere at once, not a filter applied after a lookup. The default tenant without a salt adds
# nothing: a store written before tenants existed opens and works exactly as before.
#
# A scope is ``TENANT_MARK + "t:" + token`` plus, with a salt, ``SALT_MARK + "s:" + digest``, appended to the
# caller's namespace. The token is the tenant's name when it is short and printable (so ``kvshelf ls`` can show it),
# else ``~`` and a digest; a salt is always a digest (it may be a secret of the client's and it is unbounded).

SALT_MARK = "\x1f"  # TENANT_MARK and MAX_TENANT_BYTES (what a request may name; longer: 400) live in inputs.py
_TENANT_TOKEN_BYTES = 64


def _digest(kind: str, text: str) -> str:
    return xxhash.xxh3_128_hexdigest(f"kvshelf-{kind}-v1\x00".encode() + text.encode("utf-8", "surrogatepass"))


def tenant_token(tenant: str) -> str:
    """How ``tenant`` appears inside namespaces: itself when short and printable, else ``~`` + a digest."""
    raw = tenant.encode("utf-8", "surrogatepass")
    if 0 < len(raw) <= _TENANT_TOKEN_BYTES and tenant.isprintable() and not tenant.startswith("~"):
        return tenant
    return "" if tenant == "" else "~" + _digest("tenant", tenant)


def tenant_scope(tenant: str = "", salt: str | None = None) -> str:
    """The suffix that puts a namespace in ``tenant``'s (and ``salt``'s) scope; ``""`` for the default tenant
    without a salt. Two different (tenant, salt) pairs never give the same scope."""
    if tenant == "" and salt is None:
        return ""
    scope = TENANT_MARK + "t:" + tenant_token(tenant)
    return scope + (SALT_MARK + "s:" + _digest("salt", salt) if salt is not None else "")


def scoped_namespace(namespace: str, tenant: str = "", salt: str | None = None) -> str:
    """``namespace`` as seen by ``tenant`` with ``salt``: what save, lookup and restore key by."""
    return namespace + tenant_scope(tenant, salt)


def tenant_namespace(namespace: str, tenant: str = "") -> str:
    """The library's ``tenant=`` keyword: ``namespace`` in ``tenant``'s scope, both checked first (a bad tenant is an
    ``InvalidCacheState`` naming it, not a mangled key). The default tenant leaves the namespace to the room's check."""
    if tenant == "":
        return namespace
    return scoped_namespace(check_namespace(namespace), check_tenant(tenant))


def tenant_of(namespace: str) -> str:
    """The tenant token a namespace belongs to (``""``: the default tenant); compare with ``tenant_token(name)``."""
    _base, mark, scope = namespace.rpartition(TENANT_MARK)
    if not mark or not scope.startswith("t:"):
        return ""
    return scope[2:].split(SALT_MARK, 1)[0]


def base_namespace(namespace: str) -> str:
    """The namespace without its tenant scope (what the caller named)."""
    base, mark, scope = namespace.rpartition(TENANT_MARK)
    return base if mark and scope.startswith("t:") else namespace
