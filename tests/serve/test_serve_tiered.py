"""TieredPromptCache in process: mlx-lm's LRUPromptCache in front, a real kvshelf store behind, real mlx-lm model
code and caches. What the server relies on: the longest usable prefix wins (RAM or disk), only that prefix is read,
a write-behind snapshots the cache before mlx-lm mutates it, never blocks (a full queue skips and counts), and no
store failure reaches the caller."""

from __future__ import annotations

import errno
import os

import mlx.core as mx
import pytest

from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm_models import build, forward, same
from store_cases import flip_chunk_byte

from kvshelf import Identity, open_store
from kvshelf.mlx_lm import TieredPromptCache
from kvshelf.store.base import seams

KEY = ("tiny-llama", None, None)
T = [5, 17, 42, 8, 77, 3, 61, 29, 90, 11, 13, 21, 34, 55, 2, 4, 6, 9, 12, 15]


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.fixture()
def store(tmp_path):
    with open_store(tmp_path / "store", identity=Identity("tiny-llama", "cfg", "tok")) as s:
        yield s


def filled(model, tokens):
    cache = make_prompt_cache(model)
    forward(model, tokens, cache)
    return cache


def tiered(store, **kw):
    return TieredPromptCache(LRUPromptCache(max_size=10), store, **kw)


def continue_logits(model, cache, tokens):
    return forward(model, tokens, cache)


def test_disk_serves_a_fresh_ram_tier_and_continues_bit_identically(llama, store):
    first = tiered(store)
    first.insert_cache(KEY, list(T), filled(llama, T))
    assert first.flush(timeout=60) and first.counters["writes_done"] == 1
    second = tiered(store)  # a restarted server: empty RAM, same store
    cache, rest = second.fetch_nearest_cache(KEY, T + [7, 8])
    assert rest == [7, 8] and cache[0].offset == len(T)
    assert second.counters["disk_hits"] == 1 and second.counters["disk_tokens"] == len(T)
    assert same(continue_logits(llama, cache, rest), continue_logits(llama, filled(llama, T), [7, 8]))
    again, _ = second.fetch_nearest_cache(KEY, T + [7, 8])  # every fetch is the caller's own copy
    assert again is not cache and again[0].offset == len(T)


def test_the_longer_of_ram_and_disk_wins_and_disk_is_asked_only_when_it_could_win(llama, store):
    writer = tiered(store)
    writer.insert_cache(KEY, list(T), filled(llama, T))
    writer.flush(timeout=60)
    front = tiered(store)
    front.ram.insert_cache(KEY, T[:6], filled(llama, T[:6]))  # RAM holds a shorter prefix only
    cache, rest = front.fetch_nearest_cache(KEY, T + [1])
    assert (cache[0].offset, rest) == (len(T), [1]) and front.counters["disk_hits"] == 1
    lookups = store.counters["lookups"]
    front.ram.insert_cache(KEY, T + [1, 2], filled(llama, T + [1, 2]))
    cache, rest = front.fetch_nearest_cache(KEY, T + [1, 2])  # exact RAM hit: disk cannot beat it
    assert rest == [] and front.counters["ram_hits"] == 1 and store.counters["lookups"] == lookups
    cache, rest = front.fetch_nearest_cache(KEY, [99, 98, 97])
    assert cache is None and rest == [99, 98, 97] and front.counters["misses"] == 1


def test_write_behind_snapshots_before_mlx_lm_mutates_the_cache(llama, store):
    front = tiered(store)
    cache = filled(llama, T)
    expected = [mx.array(a) for c in cache for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]
    with store.save_gate(exclusive=True):  # the write cannot run before the mutation below
        front.insert_cache(KEY, list(T), cache)
        assert front.pending_writes == 1
        for c in cache:  # what mlx-lm does next with a cache it holds: trim it and write new tokens in place
            c.trim(5)
        forward(llama, [1, 1, 1, 1, 1], cache)
    assert front.flush(timeout=60) and front.counters["writes_done"] == 1
    restored = store.restore_prefix(T + [3]).caches
    got = [a for c in restored for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]
    assert all(same(a, b) for a, b in zip(got, expected, strict=True))


def test_a_full_write_queue_skips_and_counts_instead_of_blocking(llama, store):
    front = tiered(store, queue_entries=1)
    with store.save_gate(exclusive=True):  # the one write in flight stays in flight
        front.insert_cache(KEY, list(T), filled(llama, T))
        front.insert_cache(KEY, [60, 61, 62, 63], filled(llama, [60, 61, 62, 63]))  # returns at once: skipped
        assert front.counters["writes_skipped_full"] == 1 and front.pending_writes == 1
    assert front.flush(timeout=60) and front.counters["writes_done"] == 1
    assert len(front) == 2  # both are in RAM all the same
    assert store.lookup(T + [1]) is not None and store.lookup([60, 61, 62, 63, 1]) is None


def test_a_full_disk_is_counted_and_generation_goes_on_from_ram(llama, store, request):
    def enospc(path, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device (test)", path)

    seams.FAULT_HOOK.append(enospc)
    request.addfinalizer(seams.FAULT_HOOK.clear)
    front = tiered(store)
    front.insert_cache(KEY, list(T), filled(llama, T))
    assert front.flush(timeout=60) and front.counters["writes_failed"] == 1
    cache, rest = front.fetch_nearest_cache(KEY, T + [1])
    assert rest == [1] and cache[0].offset == len(T) and front.counters["ram_hits"] == 1


def test_a_corrupted_chunk_is_a_miss_not_an_error(llama, store):
    writer = tiered(store)
    writer.insert_cache(KEY, list(T), filled(llama, T))
    writer.flush(timeout=60)
    chunks = [h for h, _ in store.admin.iter_chunks()]
    assert chunks
    for h in chunks:  # one flipped bit inside each chunk's tensor data: only the hash can tell
        flip_chunk_byte(store, h)
    front = tiered(store)
    assert front.fetch_nearest_cache(KEY, T + [1]) == (None, T + [1])
    assert front.counters["lookup_errors"] == 1 and front.counters["misses"] == 1
    assert front.fetch_nearest_cache(KEY, T + [1]) == (None, T + [1])  # quarantined: a plain miss now
    assert front.counters["lookup_errors"] == 1


def test_recurrent_layers_are_served_only_at_exact_stored_lengths(store):
    model = build("qwen3_next")
    front = tiered(store)
    front.insert_cache(KEY, list(T), filled(model, T))
    front.flush(timeout=60)
    fresh = tiered(store)
    cache, rest = fresh.fetch_nearest_cache(KEY, T + [4, 4])
    assert rest == [4, 4] and fresh.counters["disk_hits"] == 1
    assert same(forward(model, rest, cache), forward(model, [4, 4], filled(model, T)))
    cache, rest = fresh.fetch_nearest_cache(KEY, T[:10] + [4, 4])  # would need a cut of a recurrent state
    assert cache is None and fresh.counters["misses"] == 1


def test_namespaces_and_image_keys_stay_apart(llama, store):
    shared = tiered(store)
    shared.insert_cache(KEY, list(T), filled(llama, T))
    # an image of one patch token: its 60-bit id does not fit one storable id (serve/image_keys.py): RAM only
    shared.insert_cache(KEY, [-5, 3, 4, 6], filled(llama, [1, 3, 4, 6]))
    shared.flush(timeout=60)
    assert shared.counters["writes_done"] == 1 and shared.counters["writes_skipped_unstorable"] == 1
    other = tiered(store, namespace="tenant-b")
    assert other.fetch_nearest_cache(KEY, T + [1]) == (None, T + [1])
    assert tiered(store).fetch_nearest_cache(KEY, T + [1])[1] == [1]


def test_close_flushes_and_closes_and_refuses_later_writes(llama, tmp_path):
    s = open_store(tmp_path / "s", identity=Identity("m"))
    front = tiered(s)
    front.insert_cache(KEY, list(T), filled(llama, T))
    assert front.close(timeout=60) is True
    with open_store(tmp_path / "s", identity=Identity("m")) as again:
        assert again.lookup(T + [1]).length == len(T)
    front.insert_cache(KEY, [1, 2, 3], filled(llama, [1, 2, 3]))  # after close: RAM only, no error
    assert front.counters["writes_queued"] == 1 and len(front) == 2


def test_a_disk_prefix_shorter_than_min_disk_tokens_is_not_read(llama, store):
    writer = tiered(store)
    writer.insert_cache(KEY, T[:8], filled(llama, T[:8]))
    writer.flush(timeout=60)
    reads = store.counters["chunks_read"]
    assert tiered(store).fetch_nearest_cache(KEY, T) == (None, T)
    assert store.counters["chunks_read"] == reads
    cache, rest = tiered(store, min_disk_tokens=8).fetch_nearest_cache(KEY, T)
    assert cache[0].offset == 8 and rest == T[8:]


def test_the_store_budget_and_lru_govern_the_disk(llama, tmp_path):
    with open_store(tmp_path / "b", identity=Identity("tiny-llama")) as probe:
        one = probe.save("probe", T, filled(llama, T)).bytes_written
    prompts = [[91 + i, *T[1:]] for i in range(3)]  # no shared chunk: each costs `one` bytes
    budget = 2 * one + one // 2  # room for two (headers included), not three
    with open_store(tmp_path / "s", identity=Identity("tiny-llama"), max_bytes=budget) as s:
        front = tiered(s)
        for p in prompts:
            front.insert_cache(KEY, p, filled(llama, p))
            assert front.flush(timeout=60)
        assert front.counters["writes_done"] == 3 and s.counters["evicted"] == 1
        assert s.lookup(prompts[0] + [1]) is None  # the least recently used went
        assert s.lookup(prompts[2] + [1]).length == len(T)
        assert s.stats()["stored_bytes"] <= budget
