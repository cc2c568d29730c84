"""The project's byte stores run the shipped conformance suite (``kvshelf.testing.byte_store``): memory, a local
directory, and Redis (its own redis-server on 127.0.0.1) — plus what only the local store offers."""

from __future__ import annotations

import pytest

from kvshelf.store.objects.local import LocalByteStore
from kvshelf.store.objects.memory import MemoryByteStore
from kvshelf.testing.byte_store import ByteStoreTests


class TestMemoryByteStore(ByteStoreTests):
    def make_store(self, tmp_path):
        return MemoryByteStore()


class TestLocalByteStore(ByteStoreTests):
    def make_store(self, tmp_path):
        return LocalByteStore(str(tmp_path / "objects"))


class TestRedisByteStore(ByteStoreTests):
    """A RedisByteStore on its own redis-server (started on a free 127.0.0.1 port, stopped with the store)."""

    def make_store(self, tmp_path):
        from redis_servers import RedisServer

        from kvshelf.store.remote import RedisByteStore

        self._server = RedisServer()
        return RedisByteStore(self._server.url, prefix="kvshelf-conformance:")

    def close_store(self, store) -> None:
        try:
            store.close()
        finally:
            self._server.close()


def test_local_put_stream_is_all_or_nothing(tmp_path):
    """``put_stream`` is LocalByteStore's own (the save path falls back to ``put`` on other implementations)."""
    store = LocalByteStore(str(tmp_path / "objects"))
    stream = store.put_stream
    assert stream("s/1", iter([[b"ab"], [bytearray(b"cd"), memoryview(b"e")]])) == 5
    out = bytearray(5)
    store.read_into("s/1", 0, [memoryview(out)])
    assert bytes(out) == b"abcde"

    def broken():
        yield [b"xx"]
        raise RuntimeError("the producer failed mid-stream")

    with pytest.raises(RuntimeError):
        stream("s/2", broken())
    assert not store.exists("s/2")
    assert list(store.names()) == ["s/1"]  # no residue under any name
    assert not list((tmp_path / "objects" / ".tmp").iterdir())
