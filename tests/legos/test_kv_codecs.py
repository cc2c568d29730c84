"""Codecs of the key/value legos: exact round trips, prefixes, batches, validation, the snapshot file and the store."""

from __future__ import annotations

import mlx.core as mx
import msgspec
import pytest
from kv_cases import MAKERS, flat, kv, same

from kvshelf import Identity, open_store
from kvshelf.codecs import decode_entry, default_provider, encode_entry, load_snapshot, save_snapshot
from kvshelf.errors import CacheRangeError, CorruptData, IncompatibleFormat, InvalidCacheState
from kvshelf.latent_legos.kv import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, TurboQuantKVCache

P = default_provider
TOKEN_KINDS = {"kv": "kv", "qkv8": "qkv", "qkv4": "qkv", "turbo83": "turboquant", "turbo44": "turboquant"}


def token_cache(name: str, steps=(7, 5), seed: int = 0):
    cache = MAKERS[name]()
    for i, n in enumerate(steps):
        cache.update_and_fetch(*kv(1, n, seed + i))
    return cache


def ring(max_size: int, keep: int, steps, seed: int = 0) -> RotatingKVCache:
    cache = RotatingKVCache(max_size, keep)
    for i, n in enumerate(steps):
        cache.update_and_fetch(*kv(1, n, seed + i, dv=32))
    return cache


def arrays_cache(offset: int = 12, seed: int = 0, present=(0, 1)) -> ArraysCache:
    cache = ArraysCache(3)
    k1, k2 = mx.random.split(mx.random.key(seed))
    if 0 in present:
        cache[0] = mx.random.normal((1, 3, 8), key=k1).astype(mx.bfloat16)
    if 1 in present:
        cache[1] = mx.random.normal((1, 2, 4, 4), key=k2)
    cache.advance(offset)
    return cache


def all_caches(offset: int = 12) -> dict[str, object]:
    caches = {name: token_cache(name, (7, offset - 7)) for name in TOKEN_KINDS}
    caches["ring-open"] = ring(64, 2, [offset - 2, 1, 1])
    caches["ring-wrapped"] = ring(8, 2, [offset - 3, 1, 1, 1])
    caches["arrays"] = arrays_cache(offset)
    return caches


def step(cache, seed: int):
    """One more step of the model on ``cache``; what attention (or the recurrent layer) would read."""
    if isinstance(cache, ArraysCache):
        cache[1] = cache[1] * 0.5 + 1
        cache.advance(1)
        return cache.state
    dv = 32 if isinstance(cache, RotatingKVCache) else 64
    return flat(cache.update_and_fetch(*kv(1, 1, seed, dv=dv)))


def assert_same_cache(a, b) -> None:
    ea, arrays_a = P.snapshot(a)
    eb, arrays_b = P.snapshot(b)
    assert ea == eb and same(arrays_a, arrays_b)
    assert (a.signature(), a.offset, a.minimum_reusable_offset) == (b.signature(), b.offset, b.minimum_reusable_offset)
    assert same(step(a, 999), step(b, 999))


CASES = list(all_caches())


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_bit_exact_and_continues_identically(name):
    cache = all_caches()[name]
    cache.minimum_reusable_offset = 4
    entry, arrays = P.snapshot(cache)
    assert entry.offset == 12 and entry.minimum_reusable_offset == 4 and all(s.checksum for s in entry.tensors)
    entry = decode_entry(encode_entry(entry))  # the header survives its msgpack form (extra included)
    loaded = P.load(entry, arrays)
    assert type(loaded) is type(cache) and loaded.batch_size == 1
    assert_same_cache(loaded, cache)


@pytest.mark.parametrize("name", CASES)
def test_token_axes_and_trimmability(name):
    entry, _ = P.snapshot(all_caches()[name])
    codec = P.for_entry(entry)
    axes = {s.token_axis for s in entry.tensors}
    if name in TOKEN_KINDS:
        assert entry.kind == TOKEN_KINDS[name] and axes == {2} and codec.header_trimmable(entry)
    elif name == "ring-open":
        assert (entry.kind, axes, codec.header_trimmable(entry)) == ("rotating", {None}, True)
    else:
        assert axes == {None} and not codec.header_trimmable(entry)


@pytest.mark.parametrize("name", [*TOKEN_KINDS, "ring-open"])
@pytest.mark.parametrize("p", [0, 1, 5, 11])
def test_prefix_entry_loads_as_the_trimmed_cache(name, p):
    cache = all_caches()[name]
    entry, arrays = P.snapshot(cache)
    codec = P.for_entry(entry)
    cut = codec.prefix_entry(entry, p)
    assert cut.offset == p and all(s.checksum == "" for s in cut.tensors)
    pieces = []
    for slot, array in zip(cut.tensors, arrays):
        assert slot.nbytes == slot.shape[0] * slot.shape[1] * slot.shape[2] * slot.shape[3] * array.itemsize
        pieces.append(array[:, :, :p] if slot.token_axis == 2 else array)
    loaded = codec.load(cut, pieces)
    cache.trim(12 - p)
    assert_same_cache(loaded, cache)


def test_prefixes_refused_where_no_prefix_state_exists():
    for name in ("ring-wrapped", "arrays"):
        entry, arrays = P.snapshot(all_caches()[name])
        codec = P.for_entry(entry)
        with pytest.raises(CacheRangeError):
            codec.prefix_entry(entry, 11)
        whole = codec.prefix_entry(entry, 12)  # the exact length is always fine
        assert_same_cache(codec.load(whole, arrays), all_caches()[name])
    cache = token_cache("kv")
    cache.minimum_reusable_offset = 6
    entry, _ = P.snapshot(cache)
    with pytest.raises(CacheRangeError, match="minimum_reusable_offset 6"):
        P.for_entry(entry).prefix_entry(entry, 5)


@pytest.mark.parametrize("name", [*TOKEN_KINDS, "ring-open", "arrays"])
def test_load_batch_equals_loading_rows_and_merging(name):
    if name in TOKEN_KINDS:
        rows = [token_cache(name, steps, seed=10 * i) for i, steps in enumerate([(3,), (7, 2), (1,)])]
    elif name == "ring-open":
        rows = [ring(64, 2, [5, 1], seed=10 * i) for i in range(3)]  # rings batch when laid out alike
    else:
        rows = [arrays_cache(5 + i, seed=i) for i in range(3)]
    snaps = [P.snapshot(r) for r in rows]
    codec = P.for_entry(snaps[0][0])
    batched = codec.load_batch([e for e, _ in snaps], [a for _, a in snaps])
    merged = rows[0].make_empty_batch()
    merged.merge_rows([codec.load(e, a) for e, a in snaps])
    assert batched.batch_size == 3 and batched.row_offsets == merged.row_offsets == [r.offset for r in rows]
    assert same(batched.state, merged.state)
    for b, row in enumerate(rows):
        assert_same_cache(batched.extract_row(b), row)


def test_batched_and_empty_caches():
    batched = KVCache()
    batched.merge_rows([token_cache("kv"), token_cache("kv", (3,))])
    with pytest.raises(InvalidCacheState, match="extract_row"):
        P.snapshot(batched)
    for cache in (KVCache(), QuantizedKVCache(), TurboQuantKVCache(), RotatingKVCache(8), ArraysCache(2)):
        entry, arrays = P.snapshot(cache)
        assert (entry.offset, entry.tensors, arrays) == (0, [], [])
        loaded = P.load(entry, arrays)
        assert type(loaded) is type(cache) and loaded.offset == 0 and loaded.state == []
    emptied = token_cache("qkv8")
    emptied.trim(12)
    entry, arrays = P.snapshot(emptied)
    assert [s.shape for s in entry.tensors][0] == [1, 2, 0, 16]
    assert_same_cache(P.load(entry, arrays), emptied)


def replace(entry, **changes):
    return msgspec.structs.replace(entry, **changes)


def test_headers_that_contradict_their_kind_are_refused_before_any_tensor():
    entry, arrays = P.snapshot(token_cache("kv"))
    codec = P.for_entry(entry)
    bad = [
        replace(entry, bits=4),
        replace(entry, extra={**entry.extra, "kv_heads": 0}),
        replace(entry, extra={**entry.extra, "dtype": "int8"}),
        replace(entry, extra={**entry.extra, "colour": "blue"}),
        replace(entry, extra={}),
        replace(entry, tensors=[replace(entry.tensors[0], token_axis=1), entry.tensors[1]]),
    ]
    for broken in bad:
        with pytest.raises(IncompatibleFormat, match=r"entry 3 \(kv\) field"):
            codec.load(broken, arrays, index=3)
    q_entry, q_arrays = P.snapshot(token_cache("qkv8"))
    with pytest.raises(IncompatibleFormat, match="k_head_dim"):
        P.load(replace(q_entry, extra={**q_entry.extra, "k_head_dim": 96}), q_arrays)
    t_entry, t_arrays = P.snapshot(token_cache("turbo83"))
    with pytest.raises(IncompatibleFormat, match="not one of"):
        P.load(replace(t_entry, extra={**t_entry.extra, "v_head_dim": 96}), t_arrays)
    with pytest.raises(IncompatibleFormat, match="k_bits"):
        P.load(replace(t_entry, k_bits=7), t_arrays)


def test_data_that_contradicts_its_header_is_corrupt():
    entry, arrays = P.snapshot(token_cache("kv"))
    flipped = [arrays[0] + mx.array(1, dtype=arrays[0].dtype), arrays[1]]
    with pytest.raises(CorruptData, match="checksum"):
        P.load(entry, flipped)
    assert P.load(entry, flipped, verify=False).offset == 12  # the store verifies chunks itself
    with pytest.raises(CorruptData, match="slot says"):
        P.load(entry, [arrays[0][:, :, :5], arrays[1]])
    with pytest.raises(CorruptData, match="minimum_reusable_offset"):
        P.load(replace(entry, minimum_reusable_offset=13), arrays)
    r_entry, r_arrays = P.snapshot(all_caches()["ring-open"])
    with pytest.raises(CorruptData, match="head"):
        P.load(replace(r_entry, extra={**r_entry.extra, "idx": 3}), r_arrays)
    a_entry, a_arrays = P.snapshot(arrays_cache())
    with pytest.raises(IncompatibleFormat, match="present"):
        P.load(replace(a_entry, extra={**a_entry.extra, "present": "111"}), a_arrays)


def test_snapshot_file_round_trip_of_every_kind(tmp_path):
    caches = list(all_caches().values())
    tokens = list(range(100, 112))
    save_snapshot(tmp_path / "s.safetensors", tokens, caches)
    snap = load_snapshot(tmp_path / "s.safetensors")
    assert snap.tokens == tokens and [c.kind for c in snap.header.caches] == [P.for_cache(c).kind for c in caches]
    for loaded, cache in zip(snap.caches, all_caches().values()):
        assert_same_cache(loaded, cache)


def test_store_chunks_token_axis_kinds_and_restores_prefixes(tmp_path):
    tokens = list(range(1000, 1300))
    layers = lambda: [token_cache(n, (7, 293), seed=i) for i, n in enumerate(["kv", "qkv8", "turbo83"])] + [
        ring(512, 4, [300])
    ]
    with open_store(tmp_path / "store", identity=Identity("kv-model"), chunk_tokens=128) as store:
        store.save("a", tokens, layers())
        restored = store.restore("a")
        for got, want in zip(restored.caches, layers()):
            assert_same_cache(got, want)
        prefix = store.restore_prefix(tokens[:200] + [7])
        assert prefix.length == 200
        for got, want in zip(prefix.caches, layers()):
            want.trim(100)
            assert_same_cache(got, want)
        # recurrent state: reusable at its exact length only
        other = list(range(5000, 5012))
        store.save("b", other, [arrays_cache(12), token_cache("kv")])
        assert store.restore_prefix(other[:10] + [7]) is None
        exact = store.restore_prefix(other + [7])
        assert exact.length == 12 and exact.session_id == "b"
        assert_same_cache(exact.caches[0], arrays_cache(12))


def test_store_restores_kv_sessions_as_one_batch(tmp_path):
    def layers(seed, n):
        return [token_cache(kind, (n,), seed=seed + i) for i, kind in enumerate(["kv", "qkv4", "turbo44"])]

    long_tokens, short_tokens = list(range(40)), list(range(500, 509))
    with open_store(tmp_path / "store", identity=Identity("kv-model"), chunk_tokens=16) as store:
        store.save("long", long_tokens, layers(0, 40))
        store.save("short", short_tokens, layers(10, 9))
        hit = store.lookup(long_tokens[:20] + [9999])
        batch = store.restore_batch(["short", hit, "long"])
        assert batch.lengths == [9, 20, 40]
        for layer, cache in enumerate(batch.caches):
            assert cache.batch_size == 3 and cache.row_offsets == [9, 20, 40] and cache.left_pad == [31, 20, 0]
            assert_same_cache(cache.extract_row(2), layers(0, 40)[layer])
            want_cut = layers(0, 40)[layer]
            want_cut.trim(20)
            assert_same_cache(cache.extract_row(1), want_cut)
            assert_same_cache(cache.extract_row(0), layers(10, 9)[layer])
