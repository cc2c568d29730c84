"""The index-store conformance suite: one contract (``kvshelf.store.index.protocol``: snapshots, atomic writes, ordered
ranges, serialized writers, the duplicate table), every implementation.

A backend runs it by subclassing ``IndexStoreTests`` and saying how to make a fresh, empty index::

    from kvshelf.testing.index_store import IndexStoreTests

    class TestMyIndex(IndexStoreTests):
        def make_store(self, tmp_path):
            return MyIndexStore(tmp_path / "index")

``close_store`` (default: ``store.close()``) runs after each test. The suite needs the ``test`` extra (pytest,
hypothesis).
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..errors import KvShelfError
from ..store.index import IndexStore, IndexTxn

T = "chunks"  # any plain table of the store's index
U = "packs"
D = "prefix"  # the duplicate table
_pair = st.tuples(st.sampled_from([b"k1", b"k2", b"k3"]), st.binary(min_size=1, max_size=3))

# The store fixture is per test; the suite's methods run under each subclass (one executor each).
_FIXTURE_CHECKS = [HealthCheck.function_scoped_fixture, HealthCheck.differing_executors]

class IndexStoreTests:
    """Every rule of the index-transaction contract, as tests over ``self.make_store(tmp_path)``."""

    def make_store(self, tmp_path) -> IndexStore:
        raise NotImplementedError("an IndexStoreTests subclass says how to make a fresh, empty index")

    def close_store(self, store) -> None:
        store.close()

    @pytest.fixture
    def store(self, tmp_path):
        made = self.make_store(tmp_path)
        yield made
        self.close_store(made)

    def test_is_an_index_store(self, store):
        assert isinstance(store, IndexStore)
        with store.read() as t:
            assert isinstance(t, IndexTxn)

    def test_put_get_delete_count(self, store):
        store.write(lambda t: (t.put(T, b"a", b"1"), t.put(T, b"b", b"2"), t.put(U, b"a", b"x")))
        with store.read() as t:
            assert (t.get(T, b"a"), t.get(T, b"b"), t.get(U, b"a"), t.get(T, b"z")) == (b"1", b"2", b"x", None)
            assert t.count(T) == 2 and t.count(U) == 1
        assert store.write(lambda t: t.delete(T, b"a")) is True
        assert store.write(lambda t: t.delete(T, b"a")) is False
        store.write(lambda t: t.put(T, b"b", b"3"))  # put replaces
        with store.read() as t:
            assert t.get(T, b"a") is None and t.get(T, b"b") == b"3" and t.count(T) == 1

    def test_a_failed_write_changes_nothing(self, store):
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

    def test_a_read_sees_one_snapshot(self, store):
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

    def test_writers_are_serialized(self, store):
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

    @settings(max_examples=25, suppress_health_check=_FIXTURE_CHECKS)
    @given(keys=st.sets(st.binary(min_size=1, max_size=6), max_size=20), lo=st.binary(max_size=3),
           hi=st.none() | st.binary(min_size=1, max_size=3))
    def test_ranges_are_ordered_and_bounded(self, store, keys, lo, hi):
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

    def test_unknown_tables_and_kinds_are_refused(self, store):
        with store.read() as t:
            for call in (lambda: t.get("nope", b"k"), lambda: t.get(D, b"k"), lambda: t.dup_count(T, b"k")):
                with pytest.raises(KvShelfError):
                    call()

    def test_clear_and_ids(self, store):
        store.write(lambda t: (t.put(T, b"a", b"1"), t.dup_add(D, b"k", b"v"), t.put(U, b"x", b"y")))
        with store.read() as first:
            before = first.id()
        store.write(lambda t: (t.clear(T), t.clear(D)))
        with store.read() as t, store.read() as again:
            assert t.id() == again.id() != before  # one id, one committed state
            assert t.count(T) == 0 and t.count(D) == 0 and t.get(U, b"x") == b"y"
            assert list(t.range(T)) == [] and list(t.dup_items(D)) == []

    def test_duplicate_values_are_sorted_sets_per_key(self, store):
        def fill(t):
            for v in (b"c", b"a", b"b", b"a"):  # a repeated pair is kept once
                t.dup_add(D, b"k", v)
            t.dup_add(D, b"j", b"z")
            assert t.dup_count(D, b"k") == 3  # a write sees its own changes

        store.write(fill)
        with store.read() as t:
            assert t.dup_count(D, b"k") == 3 and t.dup_count(D, b"j") == 1 and t.dup_count(D, b"none") == 0
            assert t.count(D) == 4
            assert list(t.dup_from(D, b"k", b"b")) == [b"b", b"c"] and list(t.dup_from(D, b"k", b"bb")) == [b"c"]
            assert list(t.dup_from(D, b"k", b"d")) == [] and list(t.dup_from(D, b"none", b"")) == []
            assert list(t.dup_below(D, b"k", b"b")) == [b"a"]
            assert list(t.dup_below(D, b"k", b"zz")) == [b"c", b"b", b"a"]
            assert list(t.dup_below(D, b"k")) == [b"c", b"b", b"a"] and list(t.dup_below(D, b"none", b"x")) == []
            assert t.dup_has(D, b"k", b"b") and not t.dup_has(D, b"k", b"d") and not t.dup_has(D, b"j", b"a")
            assert list(t.dup_items(D)) == [(b"j", b"z"), (b"k", b"a"), (b"k", b"b"), (b"k", b"c")]
        assert store.write(lambda t: t.dup_remove(D, b"k", b"b")) is True
        assert store.write(lambda t: t.dup_remove(D, b"k", b"b")) is False
        assert store.write(lambda t: t.dup_remove(D, b"j", b"z")) is True
        with store.read() as t:
            assert list(t.dup_items(D)) == [(b"k", b"a"), (b"k", b"c")] and t.dup_count(D, b"j") == 0

    def test_a_read_keeps_its_duplicates_while_a_writer_changes_them(self, store):
        store.write(lambda t: (t.dup_add(D, b"k", b"a"), t.dup_add(D, b"k", b"b")))
        with store.read() as t:
            store.write(lambda w: (w.dup_remove(D, b"k", b"a"), w.dup_add(D, b"k", b"c")))
            assert list(t.dup_from(D, b"k", b"")) == [b"a", b"b"]
        with store.read() as t:
            assert list(t.dup_from(D, b"k", b"")) == [b"b", b"c"]

    @settings(max_examples=30, suppress_health_check=_FIXTURE_CHECKS)
    @given(ops=st.lists(st.tuples(st.booleans(), _pair), max_size=40), probe=_pair)
    def test_duplicates_agree_with_a_sorted_oracle(self, store, ops, probe):
        oracle: set[tuple[bytes, bytes]] = set()

        def apply(t):
            t.clear(D)
            for add, (k, v) in ops:
                if add:
                    t.dup_add(D, k, v)
                    oracle.add((k, v))
                else:
                    assert t.dup_remove(D, k, v) == ((k, v) in oracle)
                    oracle.discard((k, v))

        store.write(apply)
        key, value = probe
        mine = sorted(v for k, v in oracle if k == key)
        with store.read() as t:
            assert list(t.dup_items(D)) == sorted(oracle) and t.count(D) == len(oracle)
            assert t.dup_count(D, key) == len(mine) and t.dup_has(D, key, value) == ((key, value) in oracle)
            assert list(t.dup_from(D, key, value)) == [v for v in mine if v >= value]
            assert list(t.dup_below(D, key, value)) == [v for v in reversed(mine) if v < value]

    @pytest.mark.parametrize("batch", [1, 3, 512])
    def test_scan_and_batches_see_every_key_once_in_order(self, store, batch):
        keys = [bytes([i]) * 2 for i in range(1, 11)]
        store.write(lambda t: [t.put(T, k, k) for k in keys])
        ids: set[int] = set()
        assert [k for k, _ in store.scan(T, batch, ids=ids)] == keys and len(ids) == 1
        assert [k for k, _ in store.scan(T, batch, start=keys[2], stop=keys[7])] == keys[2:7]
        seen = []
        for txn, rows in store.batches(T, batch, start=keys[1]):
            assert len(rows) <= batch and all(txn.get(T, k) == v for k, v in rows)  # the batch's snapshot is open
            seen += [k for k, _ in rows]
        assert seen == keys[1:]


__all__ = ["IndexStoreTests"]
