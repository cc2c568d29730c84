"""The shared tier: chunks and a prefix index on a Redis or Valkey server (or cluster) that several hosts share.

Local stores stay authoritative; this tier only ever serves what it can verify (chunk hashes, checksummed tokens).
Modules: ``client`` (connecting), ``errors`` (redis-py → kvshelf errors), ``bytestore`` (``RedisByteStore``, the
ByteStore seam), ``breaker`` (``CircuitBreaker``), ``keys`` (the key layout), ``records`` (checksummed msgspec
records), ``index`` (the shared prefix index), ``local`` (the one module that reads the local store, through its ``StoreContext``),
``tier`` (``RemoteTier``: publish, lookup, fetch), ``gc`` (remote garbage collection).
"""

from .breaker import CircuitBreaker
from .bytestore import RedisByteStore
from .client import DEFAULT_PREFIX, RemoteConfigError, check_prefix, connect, redact

__all__ = ["CircuitBreaker", "RedisByteStore", "DEFAULT_PREFIX", "RemoteConfigError", "check_prefix", "connect",
           "redact"]
