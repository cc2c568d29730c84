"""One contract, every implementation: the index-transaction seam (``kvshelf.store.indexstore``), run on LMDB (the
store's own index) and in memory — snapshots, atomic writes, ordered ranges, serialized writers."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshelf.store.index import Index
from kvshelf.store.indexstore import IndexStore, LmdbIndexStore, MemoryIndexStore

T = "chunks"  # any plain table of the store's index; the memory store takes any name
U = "packs"


def _lmdb(tmp_path):
    index = Index(str(tmp_path / "index"))
    return LmdbIndexStore(index), index.close


INDEX_STORES = {
    "memory": lambda tmp_path: (MemoryIndexStore(), lambda: None),
    "lmdb": _lmdb,
}


@pytest.fixture(params=sorted(INDEX_STORES))
def store(request, tmp_path) -> IndexStore:
    made, close = INDEX_STORES[request.param](tmp_path)
    yield made
    close()


def test_is_an_index_store(store):
    assert isinstance(store, IndexStore)


def test_put_get_delete_count(store):
    store.write(lambda t: (t.put(T, b"a", b"1"), t.put(T, b"b", b"2"), t.put(U, b"a", b"x")))
    with store.read() as t:
        assert (t.get(T, b"a"), t.get(T, b"b"), t.get(U, b"a"), t.get(T, b"z")) == (b"1", b"2", b"x", None)
        assert t.count(T) == 2 and t.count(U) == 1
    assert store.write(lambda t: t.delete(T, b"a")) is True
    assert store.write(lambda t: t.delete(T, b"a")) is False
    store.write(lambda t: t.put(T, b"b", b"3"))  # put replaces
    with store.read() as t:
        assert t.get(T, b"a") is None and t.get(T, b"b") == b"3" and t.count(T) == 1


def test_a_failed_write_changes_nothing(store):
    store.write(lambda t: t.put(T, b"k", b"old"))

    def fail(t):
        t.put(T, b"k", b"new")
        t.put(T, b"other", b"x")
        assert t.get(T, b"k") == b"new"  # a write sees its own changes
        raise RuntimeError("abort")

    with pytest.raises(RuntimeError):
        store.write(fail)
    with store.read() as t:
        assert t.get(T, b"k") == b"old" and t.get(T, b"other") is None


def test_a_read_sees_one_snapshot(store):
    store.write(lambda t: t.put(T, b"k", b"1"))
    with store.read() as t:
        seen = t.get(T, b"k")
        done = threading.Event()

        def writer():
            store.write(lambda w: (w.put(T, b"k", b"2"), w.put(T, b"n", b"x")))
            done.set()

        th = threading.Thread(target=writer)
        th.start()
        th.join(30)
        assert done.is_set()
        assert seen == b"1" and t.get(T, b"k") == b"1" and t.get(T, b"n") is None
    with store.read() as t:
        assert t.get(T, b"k") == b"2" and t.get(T, b"n") == b"x"


def test_writers_are_serialized(store):
    store.write(lambda t: t.put(T, b"n", (0).to_bytes(8, "big")))

    def bump(_):
        for _ in range(25):
            store.write(lambda t: t.put(T, b"n", (int.from_bytes(t.get(T, b"n"), "big") + 1).to_bytes(8, "big")))

    threads = [threading.Thread(target=bump, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    with store.read() as t:
        assert int.from_bytes(t.get(T, b"n"), "big") == 100


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.sets(st.binary(min_size=1, max_size=6), max_size=20), lo=st.binary(max_size=3),
       hi=st.none() | st.binary(min_size=1, max_size=3))
def test_ranges_are_ordered_and_bounded(store, keys, lo, hi):
    def reset(t):
        for k, _v in list(t.range(T)):
            t.delete(T, k)
        for k in keys:
            t.put(T, k, k[::-1])

    store.write(reset)
    want = sorted(k for k in keys if k >= lo and (hi is None or k < hi))
    with store.read() as t:
        got = list(t.range(T, lo, hi))
    assert [k for k, _ in got] == want and all(v == k[::-1] for k, v in got)
