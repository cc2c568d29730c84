"""``RedisByteStore``: the ByteStore seam (``kvshelf.store.objects.protocol``) on a Redis or Valkey server or cluster.

Object ``name`` lives at key ``prefix + name`` (default prefix ``"kvshelf:"``, so a server shared with other
applications is safe; object names never contain braces, so each object hashes to its own cluster slot and every
command below touches one key). The contract, in Redis terms:

* ``put`` is all-or-nothing: ``SET`` of the first buffer then ``APPEND`` of the others inside one ``MULTI``/``EXEC``
  — the server applies the whole block or none of it, so a reader never sees a prefix of an object and a client
  dying mid-put leaves nothing (no temp key to clean up). Buffers go to the socket as they are (no join copy).
* ``read_into`` sends one pipelined ``GETRANGE`` per caller buffer (large buffers in ``RANGE_BYTES`` slices) and
  copies each reply into its buffer; ``STRLEN`` in the same round trip tells an absent object (``ObjectMissing``)
  and a range past the end (``CorruptData``) apart.
* ``size`` is ``STRLEN`` + ``EXISTS`` (an empty object exists with size 0); ``names`` is ``SCAN MATCH`` on the
  prefix (every master of a cluster).

Errors: a connection refused, reset or timed out → ``BackendUnavailable``; ``OOM`` (maxmemory with a noeviction
policy) → ``StoreFull``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ...errors import CorruptData, StoreFull
from ..objects.protocol import Buffer, ObjectMissing, check_name
from .client import DEFAULT_PREFIX, check_prefix, connect
from .errors import translate

RANGE_BYTES = 8 << 20  # one GETRANGE reply at most (keeps reply buffers bounded for huge objects)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisByteStore:
    """Immutable named objects in Redis (see the module docstring). Thread-safe (redis-py pools connections)."""

    supports_streaming = False
    local_paths = False
    reaps_tmp = False
    opens_readers = False

    def __init__(self, remote, *, prefix: str = DEFAULT_PREFIX, **options):
        self.client = connect(remote, **options)
        self.prefix = check_prefix(prefix)

    def key(self, name: str) -> str:
        return self.prefix + check_name(name)

    def close(self) -> None:
        self.client.close()

    def put(self, name: str, buffers: Sequence[Buffer], *, durable: bool = True) -> int:
        """All or nothing (``MULTI``/``EXEC``). ``durable`` is accepted for the seam; the server's own persistence
        settings (RDB/AOF) decide what survives its restart — the shared tier never relies on it."""
        key = self.key(name)
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if v.nbytes] or [memoryview(b"")]
        with translate(f"put {name!r}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.set(key, views[0])
            for v in views[1:]:
                pipe.append(key, v)
            pipe.execute()
        return sum(v.nbytes for v in views)

    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        key = self.key(name)
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        slices = []
        pos = offset
        for v in views:
            for at in range(0, v.nbytes, RANGE_BYTES):
                part = v[at:at + RANGE_BYTES]
                slices.append((part, pos))
                pos += part.nbytes
        with translate(f"read {name!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.strlen(key)
            pipe.exists(key)
            if offset >= 0:
                for part, at in slices:
                    pipe.getrange(key, at, at + part.nbytes - 1)
            replies = pipe.execute()
        size, exists = replies[0], replies[1]
        if not exists:
            raise ObjectMissing(f"object {name!r} does not exist")
        if offset < 0 or offset + total > size:
            raise CorruptData(f"object {name!r}: range [{offset}, {offset + total}) past its end ({size} bytes)")
        for (part, _), data in zip(slices, replies[2:]):
            if len(data) != part.nbytes:  # replaced by a shorter object between STRLEN and GETRANGE
                raise CorruptData(f"object {name!r} changed while it was read")
            part[:] = data

    def size(self, name: str) -> int | None:
        key = self.key(name)
        with translate(f"size of {name!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.strlen(key)
            pipe.exists(key)
            size, exists = pipe.execute()
        return int(size) if exists else None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> None:
        key = self.key(name)
        with translate(f"delete {name!r}"):
            self.client.delete(key)

    def names(self, prefix: str = "") -> Iterator[str]:
        pattern = _glob_escape(self.prefix + prefix) + "*"
        strip = len(self.prefix)
        with translate("list objects"):
            found = [k.decode() if isinstance(k, bytes) else k
                     for k in self.client.scan_iter(match=pattern, count=1000)]
        out = []
        for key in found:
            name = key[strip:]
            try:
                out.append(check_name(name))
            except Exception:  # another kind of kvshelf key (the prefix index) under the same prefix
                continue
        return iter(out)


__all__ = ["RedisByteStore", "StoreFull"]
