"""The shared tier: chunks and a prefix index on a Redis or Valkey server (or cluster) that several hosts share.

Local stores stay authoritative; this tier only ever serves what it can verify (chunk hashes, checksummed tokens).
Modules: ``client`` (connecting, the URL and prefix checks, redaction), ``errors`` (redis-py → kvshelf errors),
``bytestore`` (``RedisByteStore``, the ByteStore seam), ``breaker`` (``CircuitBreaker``), ``keys`` (the key layout),
``records`` (checksummed msgspec records), ``search`` (the shared prefix index, searched by ``prefix/search.py``),
``local`` (the one module that reads the local store, through its ``StoreContext``), ``fetch`` (verified chunk
fetches), ``direct`` (fetches straight into restore destinations), ``tier`` (``RemoteTier``: publish, lookup, fetch)
and ``maintenance`` (``RemoteAdmin``: listing, gc and good copies for offline tools).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.integrity``,
``store.restore``, ``store.save``, ``store.space``, ``store.liveness``, ``store.prefix``, ``store.index``,
``store.objects``, ``store.context``, ``store.identity``, ``store.inputs``, ``store.results``, ``store.base``;
``redis``; and ``kvshelf.errors``. Never a room above it, nor the façade."""

from .breaker import CircuitBreaker
from .bytestore import RedisByteStore
from .client import DEFAULT_PREFIX, RemoteConfigError, check_prefix, connect, redact

__all__ = ["CircuitBreaker", "RedisByteStore", "DEFAULT_PREFIX", "RemoteConfigError", "check_prefix", "connect",
           "redact"]
