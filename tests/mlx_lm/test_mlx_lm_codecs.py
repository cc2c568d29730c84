"""The codecs of mlx-lm's own cache classes: each class comes back as itself with the same state, a token range
holds the same bytes as kvshelf's own key/value lego (so store chunks dedupe across the two), prefixes follow
mlx-lm's trim and the prefix rules, batches are mlx-lm's ``merge``, bad entries are refused clearly.
"""

from __future__ import annotations

import mlx.core as mx
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx.utils import tree_flatten
from mlx_lm.models import cache as C

from kvshelf import Identity, open_store
from kvshelf.codecs import DEFAULT_PROVIDER_ID, default_provider
from kvshelf.errors import (
    CacheRangeError,
    CorruptData,
    IncompatibleFormat,
    InvalidCacheState,
)
from kvshelf.latent_legos import kv as ours

P = default_provider


def kv(n, heads=2, dim=64, dtype=mx.float16, seed=0):
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return (mx.random.normal((1, heads, n, dim), key=k1).astype(dtype),
            mx.random.normal((1, heads, n, dim), key=k2).astype(dtype))


def fill(cache, sizes, seed=0, **kw):
    for i, n in enumerate(sizes):
        cache.update_and_fetch(*kv(n, seed=seed + i, **kw))
    return cache


def state_equal(a, b, live: int | None = None) -> None:
    """Every state leaf equal (``live``: buffers compared on their first ``live`` positions only)."""
    assert type(a) is type(b)
    fa, fb = tree_flatten(a.state), tree_flatten(b.state)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (key, x), (_, y) in zip(fa, fb):
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            if live is not None and x.ndim == 4:
                x, y = x[..., :live, :], y[..., :live, :]
            assert mx.array_equal(x, y).item(), key
        else:
            assert x == y, key


def roundtrip(cache, length=None):
    entry, arrays = P.snapshot(cache, length=length)
    entry = msgspec.msgpack.decode(msgspec.msgpack.encode(entry), type=type(entry))  # as the store keeps it
    return entry, P.load(entry, arrays)


def rotating(max_size, keep, sizes):
    return fill(C.RotatingKVCache(max_size, keep=keep), sizes)


def trimmed(cache, n):
    cache.trim(n)
    return cache


def chunked():
    cache = fill(C.ChunkedKVCache(8), [6, 5])
    cache.maybe_trim_front()
    return cache


def arrays(with_padding=False):
    cache = C.ArraysCache(3)
    cache[0] = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    cache[2] = mx.ones((1, 2, 2), dtype=mx.bfloat16)
    if with_padding:
        cache.left_padding = mx.array([0])
    return cache


CASES = {
    "kv": lambda: fill(C.KVCache(), [5, 1, 1]),
    "kv-bf16-full": lambda: fill(C.KVCache(), [256], dtype=mx.bfloat16),
    "kv-f32-trimmed": lambda: trimmed(fill(C.KVCache(), [9], dtype=mx.float32), 3),
    "kv-empty": C.KVCache,
    "concat": lambda: fill(C.ConcatenateKVCache(), [3, 1]),
    "qkv8": lambda: fill(C.QuantizedKVCache(group_size=32, bits=8), [7, 1]),
    "qkv4": lambda: fill(C.QuantizedKVCache(group_size=64, bits=4), [3]),
    "qkv-from-kv": lambda: fill(C.KVCache(), [6]).to_quantized(group_size=32, bits=8),
    "rotating-open": lambda: rotating(16, 4, [5, 1, 1]),
    "rotating-wrapped": lambda: rotating(8, 2, [6] + [1] * 7),
    "rotating-concat": lambda: rotating(8, 0, [1] * 9 + [3]),
    "rotating-empty": lambda: C.RotatingKVCache(8, keep=4),
    "chunked": chunked,
    "arrays": arrays,
    "arrays-padded": lambda: arrays(True),
    "arrays-empty": lambda: C.ArraysCache(2),
    "list": lambda: C.CacheList(fill(C.KVCache(), [4]), fill(C.KVCache(), [4], heads=1, dim=32)),
    "list-mixed": lambda: C.CacheList(arrays(), fill(C.KVCache(), [9])),
    "list-nested": lambda: C.CacheList(C.CacheList(fill(C.KVCache(), [2]), rotating(8, 0, [2])), arrays()),
}
LENGTHS = {"arrays": 9, "arrays-padded": 9, "arrays-empty": 0, "list-mixed": 9, "list-nested": 2}


@pytest.mark.parametrize("name", list(CASES))
def test_every_class_comes_back_as_itself_with_the_same_state(name):
    cache = CASES[name]()
    entry, back = roundtrip(cache, LENGTHS.get(name))
    assert entry.kind.startswith("mlx-lm.")
    if name == "kv-f32-trimmed":  # only live positions are stored: a trimmed tail comes back as zeros
        assert back.keys.shape == cache.keys.shape and back.offset == cache.offset == 6
        assert mx.array_equal(back.keys[..., :6, :], cache.keys[..., :6, :]).item()
        assert not mx.any(back.keys[..., 6:, :]).item() and mx.any(cache.keys[..., 6:, :]).item()
    # a buffer quantized whole (to_quantized) holds nonzero scales past the offset; those come back as zeros
    state_equal(cache, back, live=cache.offset if name in ("kv-f32-trimmed", "qkv-from-kv") else None)
    for attr in ("offset", "_idx", "keep", "max_size", "group_size", "bits", "start_position", "chunk_size"):
        if hasattr(cache, attr):
            assert getattr(back, attr) == getattr(cache, attr), attr
    assert back.is_trimmable() == cache.is_trimmable()
    assert P.for_entry(entry).header_trimmable(entry) == cache.is_trimmable()
    if C.can_trim_prompt_cache([cache]) and entry.offset:  # mlx-lm's own trim works on the restored cache alike
        assert C.trim_prompt_cache([back], 1) == C.trim_prompt_cache([cache], 1) == 1
        length = entry.offset - 1
        assert P.snapshot(back, length=length)[0].offset == P.snapshot(cache, length=length)[0].offset == length


def test_the_provider_id_and_core_kinds_do_not_change_plugins_are_listed_apart():
    assert P.id == DEFAULT_PROVIDER_ID == "kvshelf-cache-v1"
    assert not any(k.startswith("mlx-lm.") for k in P.kinds)
    assert {c.kind for c in P.plugin_codecs()} >= {"mlx-lm.kv", "mlx-lm.concat", "mlx-lm.qkv", "mlx-lm.chunked",
                                                   "mlx-lm.rotating", "mlx-lm.arrays", "mlx-lm.list"}


@settings(max_examples=25)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=4), st.sampled_from([mx.float16, mx.bfloat16, mx.float32]),
       st.booleans())
def test_a_token_range_holds_the_same_bytes_as_kvshelfs_own_lego(sizes, dtype, quantized):
    """Same appends -> same slot names, dtypes, shapes, token axes and bytes (checksums) as kvshelf's legos."""
    if quantized:
        theirs, mine = C.QuantizedKVCache(group_size=32, bits=8), ours.QuantizedKVCache(group_size=32, bits=8)
    else:
        theirs, mine = C.KVCache(), ours.KVCache()
    fill(theirs, sizes, dtype=dtype)
    fill(mine, sizes, dtype=dtype)
    a, _ = P.snapshot(theirs)
    b, _ = P.snapshot(mine)
    assert a.kind != b.kind
    strip = lambda e: [(t.name, t.dtype, t.shape, t.token_axis, t.nbytes, t.checksum) for t in e.tensors]
    assert strip(a) == strip(b) and a.offset == b.offset
    assert {k: v for k, v in a.extra.items() if k != "capacity"} == b.extra


def test_the_store_dedupes_chunks_across_mlx_lm_and_kvshelf_caches(tmp_path):
    sizes = [300, 1, 1]
    with open_store(str(tmp_path / "s"), identity=Identity("m"), chunk_tokens=64) as store:
        first = store.save("ours", list(range(302)), [fill(ours.KVCache(), sizes) for _ in range(2)])
        again = store.save("theirs", list(range(302)), [fill(C.KVCache(), sizes) for _ in range(2)])
        assert first.bytes_written > 0
        assert again.bytes_written == 0 and again.bytes_reused == first.bytes_written
        back = store.restore("theirs")
        assert all(type(c) is C.KVCache and c.offset == 302 for c in back.caches)


@settings(max_examples=25)
@given(st.integers(1, 40), st.data())
def test_a_prefix_is_mlx_lms_trim(n, data):
    """Cut entry + the tensors the store would read == the live cache trimmed by mlx-lm (KVCache and an open ring)."""
    p = data.draw(st.integers(0, n))
    for make in (C.KVCache, lambda: C.RotatingKVCache(64, keep=4)):
        cache = fill(make(), [n])
        entry, arrays = P.snapshot(cache)
        codec = P.for_entry(entry)
        cut = codec.prefix_entry(entry, p)
        pieces = [a[:, :, :p, :] if s.token_axis is not None else a for a, s in zip(arrays, entry.tensors)]
        back = codec.load(cut, pieces)
        C.trim_prompt_cache([cache], n - p)
        assert back.offset == cache.offset == p
        assert getattr(back, "_idx", None) == getattr(cache, "_idx", None)
        if isinstance(cache, C.RotatingKVCache):
            assert back.keys.shape == cache.keys.shape
        else:  # mlx-lm's step-rounded buffer for p positions, never more than the saved one (issue 32)
            step_rounded = max(1, -(-p // cache.step)) * cache.step
            assert back.keys.shape == (*cache.keys.shape[:2], min(cache.keys.shape[2], step_rounded),
                                       cache.keys.shape[3])
        assert mx.array_equal(back.keys[..., :p, :], cache.keys[..., :p, :]).item()
        assert mx.array_equal(back.values[..., :p, :], cache.values[..., :p, :]).item()


def test_prefix_rules_ring_arrays_chunked_and_lists():
    wrapped = rotating(8, 2, [6] + [1] * 7)
    entry, _ = P.snapshot(wrapped)
    with pytest.raises(CacheRangeError, match="wrapped"):
        P.for_entry(entry).prefix_entry(entry, 10)
    entry, _ = P.snapshot(arrays(), length=9)
    assert not P.for_entry(entry).header_trimmable(entry)
    with pytest.raises(CacheRangeError, match="exact length"):
        P.for_entry(entry).prefix_entry(entry, 8)
    cache = chunked()
    entry, _ = P.snapshot(cache)
    assert entry.minimum_reusable_offset == cache.start_position == 3
    with pytest.raises(CacheRangeError):
        P.for_entry(entry).prefix_entry(entry, 2)
    for kids, trimmable in (([fill(C.KVCache(), [9]), fill(C.KVCache(), [9])], True),
                            ([arrays(), fill(C.KVCache(), [9])], False)):
        entry, _ = P.snapshot(C.CacheList(*kids), length=9)
        assert P.for_entry(entry).header_trimmable(entry) is trimmable is C.CacheList(*kids).is_trimmable()


def test_batched_caches_persist_one_row_at_a_time():
    one = C.BatchKVCache.merge([fill(C.KVCache(), [5])])
    entry, back = roundtrip(one)
    assert entry.kind == "mlx-lm.kv" and type(back) is C.KVCache and back.offset == 5
    ring = C.BatchRotatingKVCache.merge([rotating(8, 0, [3])])
    entry, back = roundtrip(ring)
    assert type(back) is C.RotatingKVCache and back.offset == 3
    two = C.BatchKVCache.merge([fill(C.KVCache(), [5]), fill(C.KVCache(), [3])])
    with pytest.raises(InvalidCacheState, match="holds 2 rows"):
        P.snapshot(two)
    with pytest.raises(InvalidCacheState, match="counts no positions"):
        P.snapshot(arrays())


@settings(max_examples=20)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=4))
def test_the_direct_batch_path_is_batch_kv_cache_merge(lengths):
    rows = [fill(C.KVCache(), [n]) if n else C.KVCache() for n in lengths]
    entries, arrays = zip(*(P.snapshot(r) for r in rows))
    codec = P.for_entry(entries[0])
    plan = codec.batch_plan(entries)
    filled = [mx.zeros(t.shape, dtype=getattr(mx, t.dtype)) for t in plan.tensors]
    for (row, slot), (k, start) in plan.targets().items():
        filled[k][row:row + 1, :, start:start + entries[row].offset, :] = arrays[row][slot]
    direct = codec.adopt_batch(entries, filled)
    for built in (direct, codec.load_batch(entries, arrays)):
        state_equal(built, C.BatchKVCache.merge(rows))


def test_tampered_entries_are_refused_before_any_tensor_is_trusted():
    entry, arrays = P.snapshot(fill(C.KVCache(), [5]))
    bad = msgspec.structs.replace(entry, extra={**entry.extra, "capacity": 3})
    with pytest.raises(CorruptData, match="capacity"):
        P.load(bad, arrays)
    with pytest.raises(IncompatibleFormat, match="unknown keys"):
        P.load(msgspec.structs.replace(entry, extra={**entry.extra, "surprise": 1}), arrays)
    with pytest.raises(CorruptData, match="checksum"):
        P.load(entry, [arrays[0] + 1, arrays[1]])
    entry, arrays = P.snapshot(C.CacheList(fill(C.KVCache(), [4]), fill(C.KVCache(), [4])), length=4)
    with pytest.raises(IncompatibleFormat, match="child"):
        P.load(msgspec.structs.replace(entry, extra={**entry.extra, "1.@kind": "nope"}), arrays)
    with pytest.raises(CorruptData, match="positions"):
        P.load(msgspec.structs.replace(entry, extra={**entry.extra, "1.@offset": 3}), arrays)


def test_unknown_mlx_lm_kinds_name_the_missing_integration():
    from kvshelf.codecs.provider import PluggableProvider

    bare = PluggableProvider("kvshelf-cache-v1", [], group="kvshelf.no-such-group")
    with pytest.raises(IncompatibleFormat, match=r"install mlx-lm"):
        bare.for_entry("mlx-lm.kv")
    assert np.array_equal([len(bare.plugin_codecs())], [0])


def test_save_async_keeps_the_saved_state_while_mlx_lm_keeps_writing_the_buffer(tmp_path):
    """mlx-lm writes its buffer in place (slice assignment); a pending save must still write what was saved."""
    cache = fill(C.KVCache(), [40])
    before = mx.array(cache.keys[..., :40, :])
    with open_store(str(tmp_path / "s"), identity=Identity("m"), chunk_tokens=16) as store:
        pending = store.save_async("a", list(range(40)), [cache])
        cache.trim(5)
        for i in range(5):  # overwrite positions 35..39 of the same buffer
            cache.update_and_fetch(*kv(1, seed=100 + i))
        mx.eval(cache.keys)
        pending.result()
        back = store.restore("a").caches[0]
    assert not mx.array_equal(cache.keys[..., 35:40, :], before[..., 35:40, :]).item()
    assert mx.array_equal(back.keys[..., :40, :], before).item()


def test_rows_of_another_head_geometry_do_not_batch():
    a, _ = P.snapshot(fill(C.KVCache(), [4]))
    b, _ = P.snapshot(fill(C.KVCache(), [3], heads=1))
    with pytest.raises(InvalidCacheState, match="head geometry"):
        P.for_entry(a).batch_plan([a, b])
    with pytest.raises(InvalidCacheState, match="only one kind batches"):
        P.for_entry(a).batch_plan([a, P.snapshot(fill(C.ConcatenateKVCache(), [3]))[0]])


def _tree(draw, depth: int, n: int):
    """A random CacheList tree over n positions: KVCache, open rings, ArraysCache leaves, nested lists."""
    kinds = ["kv", "ring", "arrays"] + (["list"] if depth < 2 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "kv":
        return fill(C.KVCache(), [n], heads=draw(st.integers(1, 2)), dim=32, seed=draw(st.integers(0, 9)))
    if kind == "ring":
        return rotating(n + draw(st.integers(1, 4)), draw(st.integers(0, 2)), [n])
    if kind == "arrays":
        cache = C.ArraysCache(2)
        cache[draw(st.integers(0, 1))] = mx.full((1, 2, 3), float(n))
        return cache
    return C.CacheList(*[_tree(draw, depth + 1, n) for _ in range(draw(st.integers(1, 3)))])


@settings(max_examples=30)
@given(st.data(), st.integers(1, 12))
def test_any_cache_list_tree_round_trips_and_cuts_iff_every_child_can(data, n):
    tree = C.CacheList(*[_tree(data.draw, 1, n) for _ in range(data.draw(st.integers(1, 3)))])
    entry, back = roundtrip(tree, n)

    def flat(cache):
        return [x for c in cache.caches for x in flat(c)] if isinstance(cache, C.CacheList) else [cache]

    assert [type(c) for c in flat(back)] == [type(c) for c in flat(tree)]
    for a, b in zip(flat(tree), flat(back)):
        state_equal(a, b)
    codec = P.for_entry(entry)
    assert codec.header_trimmable(entry) == tree.is_trimmable()
    if tree.is_trimmable():
        assert codec.prefix_entry(entry, n - 1).offset == n - 1
    else:
        with pytest.raises(CacheRangeError):
            codec.prefix_entry(entry, n - 1)


@settings(max_examples=15)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=3))
def test_cache_list_batches_directly_when_every_child_can_else_through_merge(lengths):
    def row(n, ring):
        first = fill(C.KVCache(), [n]) if n else C.KVCache()
        second = rotating(16, 0, [n]) if ring and n else (C.RotatingKVCache(16) if ring else
                                                          fill(C.KVCache(), [n], heads=1, dim=32) if n else C.KVCache())
        return C.CacheList(first, second)

    for ring in (False, True):
        rows = [row(n, ring) for n in lengths]
        entries, arrays = zip(*(P.snapshot(r, length=n) for r, n in zip(rows, lengths)))
        codec = P.for_entry(entries[0])
        plan = codec.batch_plan(entries)
        want = C.CacheList.merge(rows)
        if ring:
            assert plan is None
            built = codec.load_batch(entries, arrays)
        else:
            filled = [mx.zeros(t.shape, dtype=getattr(mx, t.dtype)) for t in plan.tensors]
            for (b, slot), (k, start) in plan.targets().items():
                filled[k][b:b + 1, :, start:start + entries[b].offset, :] = arrays[b][slot]
            built = codec.adopt_batch(entries, filled)
        assert type(built) is C.CacheList
        for got, expected in zip(built.caches, want.caches):
            state_equal(got, expected)
