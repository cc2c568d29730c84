"""Bytes written per cached token (issue 32): a session re-saved after every turn writes each row's bytes once.

A save cuts its chunks where the stored snapshot it extends cut them (``save/alignment.py``, ``chunking.cuts``): the
chunk ending at the old end stays a chunk, so a turn's save writes the turn's rows, not the window straddling the old
end again. And because the cuts come from the stored snapshot, not from the save's own history, whatever else extends
it — a fork restored from it under another session id, the same tokens saved from other cache objects — names the
shared rows' chunks as it did and writes nothing for them. Work is counted (``store.counters``), never timed; mlx-lm's
own ``KVCache`` (no edit epoch: its stored windows are verified by their bytes) is what is saved.
"""

from __future__ import annotations

import mlx.core as mx
from kv_cases import kv, raw
from mlx_lm.models import cache as lm
from store_cases import open_test_store

from kvshelf.store.save.chunking import cuts, min_chunk

DIMS = dict(heads=2, dk=32, dv=32, dtype=mx.float16)
LAYERS = 2
PER_TOKEN = LAYERS * DIMS["heads"] * (DIMS["dk"] + DIMS["dv"]) * 2  # float16 bytes of one position, all layers
CHUNK = 16


def grow(caches, n: int, seed: int) -> None:
    for i, c in enumerate(caches):
        c.update_and_fetch(*kv(1, n, seed * 10 + i, **DIMS))
    mx.eval([c.state for c in caches])


def bits(caches) -> list[bytes]:
    return [raw(a[..., : c.offset, :]).tobytes() for c in caches for a in (c.keys, c.values)]


def written(store) -> int:
    return store.counters["bytes_written"]


def chat(store, turns: list[int], seed: int = 1, session: str = "chat"):
    """A session of mlx-lm caches grown turn by turn and saved after every turn; returns (caches, tokens, bytes
    written by each save)."""
    caches = [lm.KVCache() for _ in range(LAYERS)]
    tokens: list[int] = []
    per_save = []
    for t, n in enumerate(turns):
        grow(caches, n, seed * 1000 + t)
        tokens += [(seed * 7 + t * 31 + i) % 5000 for i in range(n)]
        before = written(store)
        store.save(session, tokens, caches)
        per_save.append(written(store) - before)
    return caches, tokens, per_save


def test_each_turns_save_writes_only_its_rows(tmp_path):
    """Fails with cuts at multiples of ``chunk_tokens`` only: every turn rewrote the window holding the old end."""
    turns = [7] * 20  # not a divisor of the 16-token chunks, at least their quarter
    with open_test_store(tmp_path / "s", chunk_tokens=CHUNK) as store:
        caches, tokens, per_save = chat(store, turns)
        assert per_save == [n * PER_TOKEN for n in turns]  # exactly the new rows, every turn
        assert sum(per_save) == PER_TOKEN * len(tokens)
        assert bits(store.restore("chat").caches) == bits(caches)
        got = store.lookup(tokens + [1])
        assert got is not None and got.length == len(tokens)


def test_short_turns_rewrite_at_most_a_quarter_chunk_each(tmp_path):
    """Turns shorter than a quarter chunk: a short tail is rewritten once with what follows (so chunks do not stay
    tiny), which bounds each save's writes to its rows plus ``min_chunk`` rows."""
    turns = [1, 2, 3, 2, 1, 5, 2, 2, 3, 1, 2, 2]
    with open_test_store(tmp_path / "s", chunk_tokens=CHUNK) as store:
        caches, tokens, per_save = chat(store, turns, seed=2)
        for n, w in zip(turns, per_save):
            assert n * PER_TOKEN <= w <= (n + min_chunk(CHUNK)) * PER_TOKEN
        m = store.admin.manifest(store.restore("chat").snapshot_id)
        assert all(r.stop - r.start >= min_chunk(CHUNK) for r in m.chunks[:-1])
        assert bits(store.restore("chat").caches) == bits(caches)


def test_a_fork_of_a_grown_session_shares_its_chunks(tmp_path):
    """A session restored from a grown one and saved under another id cuts where the stored one cut: it writes only
    the rows it added. Fails with cuts at multiples of ``chunk_tokens`` (its windows would all be new)."""
    with open_test_store(tmp_path / "s", chunk_tokens=CHUNK) as store:
        caches, tokens, _ = chat(store, [20, 9, 9, 9, 9])
        fork = store.restore("chat").caches
        grow(fork, 5, 77)
        before = written(store)
        info = store.save("fork", tokens + [1, 2, 3, 4, 5], fork)
        assert written(store) - before == 5 * PER_TOKEN == info.bytes_written
        assert bits(store.restore("fork").caches) == bits(fork)
        assert bits(store.restore("chat").caches) == bits(caches)
        # the same tokens saved from other cache objects holding the same rows: nothing new at all
        again = [lm.KVCache() for _ in range(LAYERS)]
        for c, src in zip(again, caches):
            c.update_and_fetch(src.keys[..., : src.offset, :], src.values[..., : src.offset, :])
        mx.eval([c.state for c in again])
        assert store.save("copy", tokens, again).bytes_written == 0


def test_cuts_keep_the_stored_windows_then_follow_the_grid():
    assert cuts(40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert cuts(60, 16, [(0, 16), (16, 32), (32, 40)]) == [(0, 16), (16, 32), (32, 40), (40, 48), (48, 60)]
    # a short tail is rewritten once; a cut that would leave a sliver before the grid moves past it
    assert cuts(50, 16, [(0, 16), (16, 18)]) == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert cuts(50, 16, [(0, 16), (16, 22)]) == [(0, 16), (16, 22), (22, 32), (32, 48), (48, 50)]
    assert cuts(80, 16, [(0, 16), (16, 30)]) == [(0, 16), (16, 30), (30, 48), (48, 64), (64, 80)]
    assert cuts(80, 16, [(0, 16), (16, 45)]) == [(0, 16), (16, 45), (45, 64), (64, 80)]
    assert cuts(80, 16, [(0, 16), (16, 44)]) == [(0, 16), (16, 44), (44, 48), (48, 64), (64, 80)]
    assert cuts(80, 16, [(0, 16), (16, 62)]) == [(0, 16), (16, 62), (62, 80)]
    # windows past a shorter save are dropped (a trimmed session), and a gap ends what is kept
    assert cuts(20, 16, [(0, 16), (16, 30)]) == [(0, 16), (16, 20)]
    assert cuts(40, 16, [(0, 8), (9, 16)]) == [(0, 8), (8, 16), (16, 32), (32, 40)]
