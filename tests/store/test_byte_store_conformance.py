"""One contract, every implementation: the ByteStore conformance suite (kvshelf.store.objects.protocol).

Implementations register a factory in ``BYTE_STORES`` (name -> callable(tmp_path) returning a fresh, empty store,
or raising ``pytest.skip`` with its reason where its medium is unavailable). Every test below runs against each.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshelf.errors import CorruptData, InvalidCacheState, KvShelfError
from kvshelf.store.objects.protocol import ByteStore, ObjectMissing
from kvshelf.store.objects.memory import MemoryByteStore
from kvshelf.store.objects.local import LocalByteStore, open_object


def _redis_byte_store(tmp_path):
    """A RedisByteStore on its own redis-server (started here on a free 127.0.0.1 port, stopped on close)."""
    from redis_servers import RedisServer

    from kvshelf.store.remote import RedisByteStore

    server = RedisServer()
    made = RedisByteStore(server.url, prefix="kvshelf-conformance:")
    inner_close = made.close

    def close():
        inner_close()
        server.close()

    made.close = close
    return made


BYTE_STORES = {
    "memory": lambda tmp_path: MemoryByteStore(),
    "local": lambda tmp_path: LocalByteStore(str(tmp_path / "objects")),
    "redis": _redis_byte_store,
}


@pytest.fixture(params=sorted(BYTE_STORES))
def store(request, tmp_path) -> ByteStore:
    made = BYTE_STORES[request.param](tmp_path)
    yield made
    close = getattr(made, "close", None)
    if close is not None:
        close()


def test_is_a_byte_store(store):
    assert isinstance(store, ByteStore)


def test_put_then_read_whole_and_ranges(store):
    n = store.put("packs/a", [b"hello ", bytearray(b"world"), memoryview(b"!")])
    assert n == 12 and store.size("packs/a") == 12 and store.exists("packs/a")
    whole = bytearray(12)
    store.read_into("packs/a", 0, [memoryview(whole)])
    assert bytes(whole) == b"hello world!"
    a, b = bytearray(2), bytearray(3)
    store.read_into("packs/a", 4, [memoryview(a), memoryview(b)])
    assert bytes(a) == b"o " and bytes(b) == b"wor"


def test_empty_object_and_empty_read(store):
    assert store.put("e", []) == 0
    assert store.size("e") == 0
    store.read_into("e", 0, [])


def test_missing_object(store):
    assert store.size("nope") is None and not store.exists("nope")
    with pytest.raises(ObjectMissing):
        store.read_into("nope", 0, [memoryview(bytearray(1))])
    store.delete("nope")  # not an error


def test_read_past_end_is_corrupt(store):
    store.put("x", [b"abc"])
    with pytest.raises(CorruptData):
        store.read_into("x", 2, [memoryview(bytearray(2))])
    with pytest.raises(CorruptData):
        store.read_into("x", -1, [memoryview(bytearray(1))])


def test_replace_and_delete(store):
    store.put("k", [b"one"])
    store.put("k", [b"second"])
    out = bytearray(6)
    store.read_into("k", 0, [memoryview(out)])
    assert bytes(out) == b"second"
    store.delete("k")
    assert not store.exists("k")


def test_caller_may_reuse_its_buffers(store):
    buf = bytearray(b"abcd")
    store.put("r", [buf])
    buf[:] = b"zzzz"
    out = bytearray(4)
    store.read_into("r", 0, [memoryview(out)])
    assert bytes(out) == b"abcd"


def test_names_by_prefix(store):
    for name in ("p/1", "p/2", "q/1"):
        store.put(name, [b"."])
    assert sorted(store.names("p/")) == ["p/1", "p/2"]
    assert sorted(store.names()) >= ["p/1", "p/2", "q/1"]


@pytest.mark.parametrize("name", ["", "../x", "/abs", "a/../b", "sp ace", "x" * 256, "nul\x00", "\udc80"])
def test_hostile_names_refused(store, name):
    with pytest.raises(InvalidCacheState):
        store.put(name, [b"."])
    with pytest.raises(KvShelfError):
        store.size(name)


def test_concurrent_puts_of_distinct_objects(store):
    def put(i: int) -> None:
        store.put(f"c/{i}", [bytes([i]) * (1000 + i)])

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        out = bytearray(1000 + i)
        store.read_into(f"c/{i}", 0, [memoryview(out)])
        assert out == bytes([i]) * (1000 + i)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=4))
def test_any_ranges_read_back(store, data, cuts):
    store.put("h", [data])
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    for lo, hi in zip(bounds, bounds[1:]):
        out = bytearray(hi - lo)
        store.read_into("h", lo, [memoryview(out)])
        assert bytes(out) == data[lo:hi]


def test_put_not_durable_is_still_all_or_nothing_and_readable(store):
    assert store.put("t/1", [b"tomb", b"stone"], durable=False) == 9
    out = bytearray(9)
    store.read_into("t/1", 0, [memoryview(out)])
    assert bytes(out) == b"tombstone"


def test_open_object_reads_ranges_without_reopening(store):
    store.put("o/1", [bytes(range(200))])
    with open_object(store, "o/1") as reader:
        assert reader.size() == 200
        a, b = bytearray(10), bytearray(5)
        reader.read_into(100, [memoryview(a), memoryview(b)])
        assert bytes(a) == bytes(range(100, 110)) and bytes(b) == bytes(range(110, 115))
        with pytest.raises(CorruptData):
            reader.read_into(195, [memoryview(bytearray(10))])
    with pytest.raises(ObjectMissing):
        open_object(store, "o/none")


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
