"""The one write-behind queue (``kvshelf.store.save.write_behind``): bounded by count and bytes, one write per key,
a failed capture leaves it, actions after a key's write run before ``flush`` returns, ``close`` refuses new writes.
The store's futures are stood in for by ``concurrent.futures.Future`` objects the test completes itself (the
queue only needs a future; the writers' tests in tests/serve run it against real stores)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from kvshelf.store.save import BUSY, CLOSED, FULL, QUEUED, WriteBehindQueue


def started(futures: list):
    def start():
        futures.append(Future())
        return futures[-1]
    return start


def test_bounded_by_count_and_bytes_and_one_write_per_key():
    q, futures, done = WriteBehindQueue(max_entries=2, max_bytes=100), [], []
    assert q.submit("a", 200, started(futures), done.append) == QUEUED  # alone: larger than max_bytes goes through
    assert q.submit("b", 1, started(futures), done.append) == FULL       # bytes
    assert q.submit("a", 1, started(futures), done.append) == BUSY       # its key is in flight
    futures[0].set_result("ok")
    assert q.submit("b", 60, started(futures), done.append) == QUEUED
    assert q.submit("c", 40, started(futures), done.append) == QUEUED
    assert q.submit("d", 0, started(futures), done.append) == FULL        # count
    assert (q.pending, q.pending_bytes) == (2, 100)
    futures[1].set_exception(OSError("disk full"))
    futures[2].set_result("ok")
    assert q.flush(timeout=0) and len(done) == 3
    assert q.counts() == {"queued": 3, "written": 2, "failed": 1, "dropped": 2}


def test_a_capture_that_raises_leaves_the_queue_and_counts_as_failed():
    q = WriteBehindQueue(max_entries=1)

    def start():
        raise ValueError("no codec")

    with pytest.raises(ValueError):
        q.submit("a", 10, start, lambda f: None)
    assert q.pending == 0 and q.counts()["failed"] == 1 and not q.busy("a")


def test_an_action_after_a_key_waits_for_its_write_and_flush_waits_for_both():
    q, futures, ran = WriteBehindQueue(max_entries=4), [], []
    q.after("none-in-flight", lambda: ran.append("now"))
    assert ran == ["now"]
    q.submit("k", 0, started(futures), lambda f: ran.append("done"))
    q.after("k", lambda: ran.append("after"))
    assert ran == ["now"] and not q.flush(timeout=0)
    futures[0].set_result("ok")
    assert ran == ["now", "done", "after"] and q.flush(timeout=0)


def test_close_refuses_new_writes_and_reports_what_is_left():
    q, futures = WriteBehindQueue(max_entries=4), []
    q.submit("a", 0, started(futures), lambda f: None)
    assert q.close(timeout=0) is False                    # one write still running
    assert q.submit("b", 0, started(futures), lambda f: None) == CLOSED
    futures[0].set_result("ok")
    assert q.close(timeout=0) is True


def test_an_action_added_while_actions_run_still_runs_before_the_key_is_free():
    q, futures, ran = WriteBehindQueue(max_entries=1), [], []
    q.submit("k", 0, started(futures), lambda f: None)
    q.after("k", lambda: (ran.append("first"), q.after("k", lambda: ran.append("second"))))
    futures[0].set_result("ok")
    assert ran == ["first", "second"] and not q.busy("k") and q.flush(timeout=0)
