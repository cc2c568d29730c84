"""Connecting to the shared tier: one redis-py client (single server or cluster) from a URL, a cluster URL or seeds.

Why here: every remote piece (byte store, prefix index, tier, CLI) must reach the engine the same way — bounded
timeouts on every socket (an unreachable or stalled server is a miss, never a hang), authentication and TLS passed
straight through to redis-py (``rediss://``, ``user:password@`` in the URL, or keywords), and the same code path for
a cluster (``redis+cluster://`` / ``rediss+cluster://``, ``cluster=True``, or a list of ``host:port`` seed nodes).
Only plain RESP commands are used anywhere, so Valkey servers work as well as Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ...errors import KvShelfError

CONNECT_TIMEOUT = 0.5   # seconds to open a TCP (or TLS) connection
SOCKET_TIMEOUT = 2.0    # seconds any single reply may take (a 4 MiB GET takes milliseconds on a LAN)
DEFAULT_PREFIX = "kvshelf:"
READ_SIZE = 1 << 20      # bytes per socket read: chunks are megabytes; redis-py's 64 KiB costs a syscall per 64 KiB


class RemoteConfigError(KvShelfError, ValueError):
    """A remote URL, seed list or option kvshelf cannot use."""


def _seed(node: str) -> tuple[str, int]:
    if "://" in node:
        parts = urlsplit(node)
        return parts.hostname or "127.0.0.1", parts.port or 6379
    host, _, port = node.rpartition(":")
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise RemoteConfigError(f"seed node {node!r} is not host:port") from None


def connect(remote: str | Sequence[str] | Any, *, cluster: bool | None = None,
            connect_timeout: float = CONNECT_TIMEOUT, socket_timeout: float = SOCKET_TIMEOUT,
            **options: Any):
    """A redis-py client for ``remote``: ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS),
    ``redis+cluster://host:port`` (or ``cluster=True``) for a cluster, a list of ``host:port`` seed nodes (a
    cluster), or an already built ``redis.Redis`` / ``redis.cluster.RedisCluster`` (used as is). ``options`` go to
    redis-py unchanged (``password``, ``username``, ``ssl_ca_certs``, ``ssl_certfile``, ...)."""
    try:
        import redis
        from redis.cluster import ClusterNode, RedisCluster
    except ImportError:  # pragma: no cover - the extra is not installed
        raise RemoteConfigError("the shared tier needs the redis client: pip install 'kvshelf[redis]'") from None
    if isinstance(remote, (redis.Redis, RedisCluster)):
        return remote
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # one immediate retry (a pooled connection gone stale after a server restart), not redis-py's default three
    # with backoff: a remote fault must cost a bounded, small time before it becomes a miss
    options.setdefault("retry", Retry(NoBackoff(), 1))
    options.setdefault("socket_read_size", READ_SIZE)
    common = dict(socket_connect_timeout=connect_timeout, socket_timeout=socket_timeout, **options)
    if isinstance(remote, (list, tuple)):
        if not remote:
            raise RemoteConfigError("a seed node list must name at least one host:port")
        nodes = [ClusterNode(*_seed(str(n))) for n in remote]
        return RedisCluster(startup_nodes=nodes, **common)
    if not isinstance(remote, str):
        raise RemoteConfigError(f"remote must be a URL, a list of seed nodes or a redis client, got "
                                f"{type(remote).__name__}")
    try:
        parts = urlsplit(remote)
        parts.port  # noqa: B018 - parsed lazily: a bad port raises here, not deep inside redis-py
    except ValueError as exc:  # one line naming the URL (without its password), never a traceback
        raise RemoteConfigError(f"remote URL {redact(remote)!r} cannot be parsed: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in ("redis+cluster", "rediss+cluster"):
        cluster, scheme = True, scheme.split("+")[0]
    if scheme not in ("redis", "rediss", "unix", "valkey", "valkeys"):
        raise RemoteConfigError(f"remote URL {redact(remote)!r}: scheme must be redis://, rediss://, "
                                f"redis+cluster:// or unix://")
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(scheme, scheme)
    url = urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))
    try:
        if cluster:
            return RedisCluster.from_url(url, **common)
        return redis.Redis.from_url(url, health_check_interval=0, **common)
    except (ValueError, redis.RedisError) as exc:
        raise RemoteConfigError(f"remote {redact(remote)!r}: {exc}") from None


def redact(remote: Any) -> str:
    """The URL without its password (for messages, stats and the CLI)."""
    if not isinstance(remote, str):
        return repr(remote) if isinstance(remote, (list, tuple)) else type(remote).__name__
    try:
        parts = urlsplit(remote)
        port = parts.port
    except ValueError:  # unparseable: where a password would be is unknown, so only the scheme and the host part
        scheme, sep, rest = remote.partition("://")
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else remote
    if parts.password is None:
        return remote
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{port}" if port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def check_prefix(prefix: str) -> str:
    """Key prefixes namespace kvshelf inside a shared server; braces would change cluster hash slots."""
    if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix or len(prefix) > 128:
        raise RemoteConfigError(f"remote_prefix must be a non-empty str of at most 128 characters without braces, "
                                f"got {prefix!r}")
    return prefix


__all__ = ["connect", "redact", "check_prefix", "RemoteConfigError", "DEFAULT_PREFIX", "CONNECT_TIMEOUT",
           "SOCKET_TIMEOUT"]
