"""The byte-store conformance suite: one contract (``kvshelf.store.objects.protocol.ByteStore``), every implementation.

A backend — the project's own or a third party's — runs it by subclassing ``ByteStoreTests`` in a test module and
saying how to make a fresh, empty store (pytest collects the subclass because its name starts with ``Test``)::

    from kvshelf.testing.byte_store import ByteStoreTests

    class TestMyByteStore(ByteStoreTests):
        def make_store(self, tmp_path):
            return MyByteStore(tmp_path / "objects")

``close_store`` (default: ``store.close()`` where the store has one) runs after each test. The suite needs the
``test`` extra (pytest, hypothesis).
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..errors import CorruptData, InvalidCacheState, KvShelfError
from ..store.objects import ByteStore, ObjectMissing, open_object

# The store fixture is per test; the suite's methods run under each subclass (one executor each).
_FIXTURE_CHECKS = [HealthCheck.function_scoped_fixture, HealthCheck.differing_executors]

class ByteStoreTests:
    """Every rule of the ByteStore contract, as tests over ``self.make_store(tmp_path)``."""

    def make_store(self, tmp_path) -> ByteStore:
        raise NotImplementedError("a ByteStoreTests subclass says how to make a fresh, empty store")

    def close_store(self, store) -> None:
        close = getattr(store, "close", None)
        if close is not None:
            close()

    @pytest.fixture
    def store(self, tmp_path):
        made = self.make_store(tmp_path)
        yield made
        self.close_store(made)

    def test_is_a_byte_store(self, store):
        assert isinstance(store, ByteStore)

    def test_put_then_read_whole_and_ranges(self, store):
        n = store.put("packs/a", [b"hello ", bytearray(b"world"), memoryview(b"!")])
        assert n == 12 and store.size("packs/a") == 12 and store.exists("packs/a")
        whole = bytearray(12)
        store.read_into("packs/a", 0, [memoryview(whole)])
        assert bytes(whole) == b"hello world!"
        a, b = bytearray(2), bytearray(3)
        store.read_into("packs/a", 4, [memoryview(a), memoryview(b)])
        assert bytes(a) == b"o " and bytes(b) == b"wor"

    def test_empty_object_and_empty_read(self, store):
        assert store.put("e", []) == 0
        assert store.size("e") == 0
        store.read_into("e", 0, [])

    def test_missing_object(self, store):
        assert store.size("nope") is None and not store.exists("nope")
        with pytest.raises(ObjectMissing):
            store.read_into("nope", 0, [memoryview(bytearray(1))])
        store.delete("nope")  # not an error

    def test_read_past_end_is_corrupt(self, store):
        store.put("x", [b"abc"])
        with pytest.raises(CorruptData):
            store.read_into("x", 2, [memoryview(bytearray(2))])
        with pytest.raises(CorruptData):
            store.read_into("x", -1, [memoryview(bytearray(1))])

    def test_replace_and_delete(self, store):
        store.put("k", [b"one"])
        store.put("k", [b"second"])
        out = bytearray(6)
        store.read_into("k", 0, [memoryview(out)])
        assert bytes(out) == b"second"
        store.delete("k")
        assert not store.exists("k")

    def test_caller_may_reuse_its_buffers(self, store):
        buf = bytearray(b"abcd")
        store.put("r", [buf])
        buf[:] = b"zzzz"
        out = bytearray(4)
        store.read_into("r", 0, [memoryview(out)])
        assert bytes(out) == b"abcd"

    def test_names_by_prefix(self, store):
        for name in ("p/1", "p/2", "q/1"):
            store.put(name, [b"."])
        assert sorted(store.names("p/")) == ["p/1", "p/2"]
        assert sorted(store.names()) >= ["p/1", "p/2", "q/1"]

    @pytest.mark.parametrize("name", ["", "../x", "/abs", "a/../b", "sp ace", "x" * 256, "nul\x00", "\udc80"])
    def test_hostile_names_refused(self, store, name):
        with pytest.raises(InvalidCacheState):
            store.put(name, [b"."])
        with pytest.raises(KvShelfError):
            store.size(name)

    def test_concurrent_puts_of_distinct_objects(self, store):
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

    @settings(max_examples=25, suppress_health_check=_FIXTURE_CHECKS)
    @given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=4))
    def test_any_ranges_read_back(self, store, data, cuts):
        store.put("h", [data])
        bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
        for lo, hi in zip(bounds, bounds[1:]):
            out = bytearray(hi - lo)
            store.read_into("h", lo, [memoryview(out)])
            assert bytes(out) == data[lo:hi]

    def test_put_not_durable_is_still_all_or_nothing_and_readable(self, store):
        assert store.put("t/1", [b"tomb", b"stone"], durable=False) == 9
        out = bytearray(9)
        store.read_into("t/1", 0, [memoryview(out)])
        assert bytes(out) == b"tombstone"

    def test_open_object_reads_ranges_without_reopening(self, store):
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


__all__ = ["ByteStoreTests"]
