"""redis-py errors turned into kvshelf's: an unreachable or stalled server is ``BackendUnavailable`` (the tier reads
it as a miss and tells its circuit breaker), a full server with a noeviction policy is ``StoreFull``."""

from __future__ import annotations

from contextlib import contextmanager

from ...errors import StoreFull
from ..objects.protocol import BackendUnavailable


@contextmanager
def translate(what: str):
    import redis

    try:
        yield
    except redis.exceptions.ResponseError as exc:
        text = str(exc)
        if text.startswith("OOM"):
            raise StoreFull(f"remote {what}: the server is full ({text})") from None
        raise BackendUnavailable(f"remote {what}: {text}") from None
    except (redis.exceptions.RedisError, OSError) as exc:
        raise BackendUnavailable(f"remote {what}: {type(exc).__name__}: {exc}") from None


__all__ = ["translate", "BackendUnavailable"]
