"""For every reachable state (random appends, trims and speculative rounds), a snapshot loads back bit-exactly and
continues identically; every prefix the header allows loads as the trimmed cache."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cases import MAKERS, flat, kv, same

from kvshelf.codecs import default_provider as P
from kvshelf.errors import CacheRangeError
from kvshelf.latent_legos.kv import RotatingKVCache

step_st = st.one_of(
    st.tuples(st.just("append"), st.sampled_from([1, 1, 1, 2, 3, 9])),
    st.tuples(st.just("trim"), st.integers(0, 3)),
    st.tuples(st.just("round"), st.tuples(st.integers(1, 4), st.integers(0, 4))),
)


def run(cache, steps, dv=64):
    for i, (op, arg) in enumerate(steps):
        if op == "append":
            cache.update_and_fetch(*kv(1, arg, 700 + i, heads=1, dv=dv))
        elif op == "trim" and cache.is_trimmable():
            cache.trim(min(arg, cache.offset))
        elif op == "round":
            n, keep = arg
            cache.spec_round_begin()
            cache.update_and_fetch(*kv(1, n, 800 + i, heads=1, dv=dv))
            try:
                cache.spec_round_rollback(min(keep, n))
            except CacheRangeError:  # a wrapped ring refuses (changing nothing); the round then commits
                assert isinstance(cache, RotatingKVCache)
                cache.spec_round_commit()
    return cache


def check_round_trip(build, dv=64):
    cache = build()
    entry, arrays = P.snapshot(cache)
    loaded = P.load(entry, arrays)
    again, arrays_again = P.snapshot(loaded)
    assert again == entry and same(arrays_again, arrays)
    if entry.offset:
        nxt = kv(1, 1, 999, heads=1, dv=dv)
        assert same(flat(loaded.update_and_fetch(*nxt)), flat(cache.update_and_fetch(*nxt)))
    codec = P.for_entry(entry)
    if codec.header_trimmable(entry):
        for p in sorted({0, entry.offset // 2, max(entry.offset - 1, 0)}):
            cut = codec.prefix_entry(entry, p)
            pieces = [a[:, :, :p] if s.token_axis == 2 else a for s, a in zip(cut.tensors, arrays)]
            trimmed = build()
            trimmed.trim(trimmed.offset - p)
            got, want = P.snapshot(codec.load(cut, pieces)), P.snapshot(trimmed)
            assert got[0] == want[0] and same(got[1], want[1])


@settings(max_examples=25)
@given(kind=st.sampled_from(sorted(MAKERS)), steps=st.lists(step_st, min_size=1, max_size=6))
def test_token_axis_kinds_round_trip_from_any_state(kind, steps):
    check_round_trip(lambda: run(MAKERS[kind](), steps))


@settings(max_examples=40)
@given(
    max_size=st.sampled_from([4, 7, 16]),
    keep=st.sampled_from([0, 1, 3]),
    steps=st.lists(step_st, min_size=1, max_size=10),
)
def test_rings_round_trip_from_any_state(max_size, keep, steps):
    check_round_trip(lambda: run(RotatingKVCache(max_size, keep), steps, dv=32), dv=32)
