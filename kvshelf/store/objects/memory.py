"""The byte store in process memory: the second implementation of the seam (``protocol.ByteStore``).

Why it exists: tests and the conformance suite need a store that never touches disk, and a scratch store is useful
to callers who only want the session store's logic (dedupe, prefix reuse) for one process's lifetime.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from ...errors import CorruptData
from .protocol import Buffer, ObjectMissing, check_name


class MemoryByteStore:
    """A ByteStore in process memory: the second implementation of the seam (tests, the conformance suite, and a
    scratch store that never touches disk). Thread-safe; objects are copied in on ``put`` so callers may reuse
    their buffers."""

    supports_streaming = False
    local_paths = False
    reaps_tmp = False
    opens_readers = False

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, name: str, buffers: Sequence[Buffer], *, durable: bool = True) -> int:
        check_name(name)
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        with self._lock:
            self._objects[name] = data
        return len(data)

    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        check_name(name)
        with self._lock:
            data = self._objects.get(name)
        if data is None:
            raise ObjectMissing(f"object {name!r} does not exist")
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        if offset < 0 or offset + total > len(data):
            raise CorruptData(f"object {name!r}: range [{offset}, {offset + total}) past its end ({len(data)} bytes)")
        pos = offset
        for v in views:
            v[:] = data[pos:pos + v.nbytes]
            pos += v.nbytes

    def size(self, name: str) -> int | None:
        check_name(name)
        with self._lock:
            data = self._objects.get(name)
        return None if data is None else len(data)

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> None:
        check_name(name)
        with self._lock:
            self._objects.pop(name, None)

    def names(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            found = [n for n in self._objects if n.startswith(prefix)]
        return iter(found)


__all__ = ["MemoryByteStore"]
