"""Pins on a real store: a pinned session outlives a budget that evicts everything else, a pin's TTL runs from its
last use (a hit refreshes it), pins never hold more than ``max_pinned_bytes`` (default half the budget), and a
delete drops the pin with the session."""

from __future__ import annotations

import time

import pytest
from codec_cases import CASES_BY_ID
from store_cases import open_test_store, session, token_ids

from kvshelf.errors import KvShelfError, SnapshotNotFound
from kvshelf.store.space.pins import PinLimitExceeded

MLA = CASES_BY_ID["mla-f32-nodsa"]
PER_TOKEN = 2 * (64 + 32) * 4  # two f32 MLA layers of widths 64 + 32
SNAP = 48 * PER_TOKEN


def mla(n, seed=0):
    return session(MLA, (n,), seed)


def save(store, name, seed):
    store.save(name, token_ids(48, seed=seed), mla(48, seed=seed))


def test_pinned_sessions_survive_a_budget_that_evicts_the_others(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16, max_bytes=int(4.5 * SNAP)) as store:
        save(store, "sys-a", 1)
        save(store, "sys-b", 2)
        store.pin("sys-a")
        store.pin("sys-b")  # the two least recently used; 2 of the 2.25 snapshots pins may hold
        assert store.stats()["pinned_bytes"] == 2 * SNAP
        for i in range(3, 9):
            save(store, f"chat-{i}", i)
        names = {s.session_id for s in store.sessions()}
        assert {"sys-a", "sys-b"} <= names
        assert names == {"sys-a", "sys-b", "chat-7", "chat-8"}
        assert store.counters["evicted"] == 4
        assert store.unpin("sys-a") and not store.unpin("sys-a")
        save(store, "chat-9", 9)  # sys-a is the LRU now and no longer pinned
        assert "sys-a" not in {s.session_id for s in store.sessions()}
        assert store.stats()["pinned_bytes"] == SNAP


def test_a_pin_beyond_the_limit_is_refused_and_changes_nothing(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16, max_bytes=int(3.5 * SNAP)) as store:
        for name, seed in (("a", 1), ("b", 2), ("c", 3)):
            save(store, name, seed)
        store.pin("a")  # limit: half of 3.5 snapshots = 1.75 snapshots
        with pytest.raises(PinLimitExceeded, match=r"session 'b'.*over the pin limit of \d+ bytes") as info:
            store.pin("b")
        assert isinstance(info.value, KvShelfError) and str(tmp_path / "s") in str(info.value)
        assert [p.session_id for p in store.pins.listing()] == ["a"]
        store.pins.set_limit(3 * SNAP)  # an explicit limit (the server's --max-pinned-bytes)
        store.pin("b")
        assert {p.session_id for p in store.pins.listing()} == {"a", "b"}
        with pytest.raises(SnapshotNotFound, match="no session 'nope'"):
            store.pin("nope")


class FakeClock:
    """The pins' clock (``open_store(clock=...)``), moved by the test: a TTL is checked without waiting it out."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def last_used(store, name: str) -> float:
    return {s.session_id: s.last_used for s in store.sessions()}[name]


def test_a_ttl_runs_from_the_last_use_and_then_the_pin_protects_nothing(tmp_path):
    # The last uses are the LRU's, stamped by the real clock; the fake one starts there and is then moved past them.
    clock = FakeClock(time.time())
    with open_test_store(tmp_path / "s", chunk_tokens=16, max_bytes=int(2.5 * SNAP), clock=clock) as store:
        save(store, "kept", 1)
        save(store, "lapsed", 2)
        store.pins.set_limit(10 * SNAP)
        clock.now = pinned = max(time.time(), last_used(store, "lapsed"))  # pinned after both were last used
        store.pin("kept", ttl=3.0)
        store.pin("lapsed", ttl=3.0)
        store.restore("kept")  # a hit: its TTL now runs from here
        hit = last_used(store, "kept")
        assert hit > pinned
        clock.now = pinned + 3.0 + (hit - pinned) / 2  # past "lapsed"'s pin + ttl; "kept"'s runs from its hit
        save(store, "c", 3)  # writes the hit (the LRU's touch is written by the next write), then evicts
        save(store, "d", 4)
        names = {s.session_id for s in store.sessions()}
        assert "kept" in names and "lapsed" not in names
        assert [p.session_id for p in store.pins.listing()] == ["kept"]
        clock.now = hit + 3.0 + 1.0  # now "kept" lapsed too
        assert [p.session_id for p in store.pins.listing()] == []
        save(store, "e", 5)
        assert "kept" not in {s.session_id for s in store.sessions()}


def test_delete_drops_the_pin_and_an_admin_handle_pins_by_session_id(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        save(store, "a", 1)
        store.pin("a")
        store.delete("a")
        assert store.pins.listing() == [] and store.stats()["pinned_bytes"] == 0
        save(store, "a", 1)
        assert store.pins.listing() == []  # a session saved again under that id is not pinned by a past pin
    from kvshelf import open_store

    with open_store(tmp_path / "s", admin=True) as admin:
        (pin,) = admin.pin("a", ttl=60)
        assert pin.nbytes == SNAP and pin.expires_at is not None
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        assert [p.session_id for p in store.pins.listing()] == ["a"]
