"""Incremental saves of mlx-lm's own caches (issue 32): a save of a session that extends a stored one *writes* only
the new rows, and its stored rows are *verified* (hashed again from the live buffers and compared by name), never
trusted: mlx-lm's ``KVCache``, ``QuantizedKVCache`` (its three planes: packed data, scales, biases) and
``RotatingKVCache`` before its ring wraps (stored as rows) carry no edit epoch, and a row rewritten in place keeps the
object, the array and the buffer. These tests count the work through ``store.counters`` (bytes, not time) and drive
random same-length edits of stored rows (a row's bits flipped in the very array the cache holds; mlx-lm's own
``trim`` + ``update_and_fetch`` with other values) to show a changed row is never taken as unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_cases import kv, raw
from mlx_lm.models import cache as lm
from store_cases import open_test_store

from kvshelf.store.objects.chunkfile import content_hash
from kvshelf.store.save.chunking import plan_chunks

DIMS = dict(heads=2, dk=64, dv=64, dtype=mx.float16)
KINDS = {
    "kv": lm.KVCache,
    "qkv8": lambda: lm.QuantizedKVCache(group_size=64, bits=8),
    "rotating": lambda: lm.RotatingKVCache(max_size=4096),  # unwrapped (offset < max_size): stored as rows
}
COUNTERS = ("chunks_written", "bytes_written", "chunks_hashed", "bytes_hashed", "chunks_verified", "bytes_verified",
            "chunks_hash_reused")


def grow(cache, n: int, seed: int) -> None:
    cache.update_and_fetch(*kv(1, n, seed, **DIMS))


def session(kind: str, n: int, seed: int, layers: int = 2) -> list:
    caches = [KINDS[kind]() for _ in range(layers)]
    for i, c in enumerate(caches):
        grow(c, n, seed * 10 + i)
    mx.eval([c.state for c in caches])
    return caches


def planes(cache) -> list[mx.array]:
    """The arrays holding the cache's rows (token axis 2), as the cache holds them (no copies)."""
    if isinstance(cache, lm.QuantizedKVCache):
        return [*cache.keys, *cache.values]
    return [cache.keys, cache.values]


def state_bits(caches) -> list[bytes]:
    """Every row the caches hold below their offsets, as bits (what a restore must give back)."""
    out = []
    for c in caches:
        for a in planes(c):
            out.append(raw(a[..., : c.offset, :]).tobytes())
    return out


def window_bits(caches, n: int, chunk_tokens: int = 4) -> list[bytes]:
    """Per token window below ``n``: the bits of its rows across every cache and plane."""
    return [b"".join(raw(a[..., w: min(w + chunk_tokens, n), :]).tobytes() for c in caches for a in planes(c))
            for w in range(0, n, chunk_tokens)]


def counts(store) -> dict[str, int]:
    return {k: store.counters[k] for k in COUNTERS}


def delta(before, after) -> dict[str, int]:
    return {k: after[k] - before[k] for k in COUNTERS}


def scratch_hashes(caches, chunk_tokens: int, windows=()) -> list[str]:
    """The chunk names of the caches' current content hashed from scratch, cut at ``windows`` (a manifest's; token
    chunks, then the own one)."""
    from kvshelf.codecs import default_provider

    snaps = [default_provider.snapshot(c, checksums=False) for c in caches]
    mx.eval([a for _, arrs in snaps for a in arrs])
    return [content_hash(p.pieces) for p in plan_chunks([e for e, _ in snaps], [list(a) for _, a in snaps],
                                                        chunk_tokens, windows)]


def windows_of(store, snapshot_id: str) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in store.admin.manifest(snapshot_id).chunks]


def manifest_hashes(store, snapshot_id: str) -> list[str]:
    m = store.admin.manifest(snapshot_id)
    return [r.hash for r in m.chunks] + [r.hash for r in m.own]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_grown_mlx_lm_session_writes_only_the_new_rows(tmp_path, kind):
    caches = session(kind, 1024, 1)
    with open_test_store(tmp_path / "s", chunk_tokens=256) as store:
        first = store.save("chat", list(range(1024)), caches)
        assert first.chunks_written == 4
        per_chunk = first.bytes_written // 4
        for i, c in enumerate(caches):
            grow(c, 256, 50 + i)
        before = counts(store)
        info = store.save("chat", list(range(1280)), caches)
        d = delta(before, counts(store))
        # written: the one new window; verified: the four stored ones, hashed again from the live buffers
        assert (d["chunks_written"], d["bytes_written"]) == (1, per_chunk) == (info.chunks_written, info.bytes_written)
        assert (d["chunks_verified"], d["bytes_verified"]) == (4, 4 * per_chunk)
        assert (d["chunks_hashed"], d["bytes_hashed"], d["chunks_hash_reused"]) == (5, 5 * per_chunk, 0)
        restored = store.restore("chat").caches
        assert state_bits(restored) == state_bits(caches)
        assert manifest_hashes(store, info.snapshot_id) == scratch_hashes(caches, 256, windows_of(store, info.snapshot_id))


# one edit: (layer, plane, position as a fraction of the stored length, seed of the bit mask)
EDIT = st.tuples(st.integers(0, 1), st.integers(0, 5), st.floats(0, 0.999), st.integers(0, 2**31 - 1))


def flip_row(cache, plane: int, pos: int, seed: int) -> None:
    """Flip some bits of row ``pos`` of one plane, in the very array the cache holds (same object, same length)."""
    arrs = planes(cache)
    arr = arrs[plane % len(arrs)]
    row = arr[..., pos : pos + 1, :]
    ints = {2: mx.uint16, 4: mx.uint32}[row.dtype.size]
    mask = np.random.default_rng(seed).integers(0, 2 ** (8 * row.dtype.size), size=row.shape, dtype=np.uint64)
    mask.flat[seed % mask.size] |= 1  # never all zero: the row's bytes really change
    arr[..., pos : pos + 1, :] = (row.view(ints) ^ mx.array(mask.astype(np.uint32)).astype(ints)).view(row.dtype)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(KINDS)), n=st.integers(4, 40), edits=st.lists(EDIT, min_size=1, max_size=3),
       via_trim=st.booleans(), more=st.integers(0, 9), seed=st.integers(0, 1000))
def test_a_changed_stored_row_is_never_taken_as_unchanged(tmp_path_factory, kind, n, edits, via_trim, more, seed):
    caches = session(kind, n, seed)
    with open_test_store(tmp_path_factory.mktemp("s"), chunk_tokens=4) as store:
        first = store.save("s", list(range(n)), caches)
        old = manifest_hashes(store, first.snapshot_id)
        stored_bits = window_bits(caches, n)
        for layer, plane, frac, mask_seed in edits:
            pos = int(frac * n)
            if via_trim:  # mlx-lm's own path: roll back to pos, write other values (same length again)
                cache = caches[layer]
                cache.trim(n - pos)
                grow(cache, n - pos, mask_seed)
            else:
                flip_row(caches[layer], plane, pos, mask_seed)
        mx.eval([c.state for c in caches])
        changed = [a != b for a, b in zip(stored_bits, window_bits(caches, n))]
        for i, c in enumerate(caches):
            if more:
                grow(c, more, seed + 500 + i)
        expected = state_bits(caches)
        before = counts(store)
        info = store.save("s", list(range(n + more)), caches)
        d = delta(before, counts(store))
        new = manifest_hashes(store, info.snapshot_id)
        assert new == scratch_hashes(caches, 4, windows_of(store, info.snapshot_id))  # the current bytes' names
        assert state_bits(store.restore("s").caches) == expected
        # a window whose bits changed names other bytes: a new chunk (written), never the stored one; the others
        # dedupe onto what was stored (their full windows; the last one may have grown)
        for w, differs in enumerate(changed):
            if differs:
                assert new[w] != old[w]
            elif 4 * (w + 1) <= n:
                assert new[w] == old[w]
        assert d["chunks_hash_reused"] == 0 and d["chunks_verified"] >= 1


def test_same_object_and_buffer_prove_nothing(tmp_path):
    """Why the stored windows are verified by their bytes: mlx-lm's ``trim`` + ``update_and_fetch`` rewrites rows in
    the very buffer that was saved (same cache, same array object, same data pointer, same length), so any check of
    identity would take the rewritten window as the stored one."""
    caches = session("kv", 16, 3)
    pointer = [np.array(c.keys, copy=False).ctypes.data for c in caches]
    objects = [id(c.keys) for c in caches]
    with open_test_store(tmp_path / "s", chunk_tokens=4) as store:
        first = store.save("s", list(range(16)), caches)
        old = manifest_hashes(store, first.snapshot_id)
        caches[0].trim(6)
        grow(caches[0], 6, 77)  # rows [10, 16) of layer 0: other values
        mx.eval([c.state for c in caches])
        assert [np.array(c.keys, copy=False).ctypes.data for c in caches] == pointer
        assert [id(c.keys) for c in caches] == objects and caches[0].offset == 16
        info = store.save("s", list(range(16)), caches)
        new = manifest_hashes(store, info.snapshot_id)
        assert new[:2] == old[:2] and new[2] != old[2] and new[3] != old[3]
        assert info.chunks_written == 2
        assert state_bits(store.restore("s").caches) == state_bits(caches)


def test_rotating_cache_is_saved_as_rows_until_its_ring_wraps(tmp_path):
    """mlx-lm's ``RotatingKVCache`` before its ring wraps holds position p at slot p: stored as rows (token axis), a
    grown session writes only its new rows; once the ring has turned it is stored whole, and both restore bit-exact
    and continue as the original does."""
    caches = [lm.RotatingKVCache(max_size=32) for _ in range(2)]
    for i, c in enumerate(caches):
        grow(c, 20, 300 + i)
    with open_test_store(tmp_path / "s", chunk_tokens=4) as store:
        first = store.save("s", list(range(20)), caches)
        per_row = first.bytes_written // 20
        m = store.admin.manifest(first.snapshot_id)
        assert not m.own and all(e.extra["rows"] for e in m.entries)
        for step in range(5):  # one position at a time: mlx-lm's in-place path, up to the slot before the turn
            for i, c in enumerate(caches):
                grow(c, 1, 400 + 10 * step + i)
            n = 21 + step
            info = store.save("s", list(range(n)), caches)
            assert info.bytes_written == per_row  # the one new row
            assert state_bits(store.restore("s").caches) == state_bits(caches)
        prefix = store.restore_prefix(list(range(9)) + [999]).caches  # rows cut at 9, as mlx-lm's trim leaves it
        assert [c.offset for c in prefix] == [9, 9]
        assert state_bits(prefix) == [raw(a[..., :9, :]).tobytes() for c in caches for a in planes(c)]
        for i, c in enumerate(caches):  # past max_size: the ring turns; stored whole from now on
            grow(c, 1, 500 + i)
            for k in range(12):
                grow(c, 1, 600 + 20 * k + i)
        info = store.save("s", list(range(38)), caches)
        m = store.admin.manifest(info.snapshot_id)
        assert m.own and not any("rows" in e.extra for e in m.entries)
        restored = store.restore("s").caches
        for a, b in zip(restored, caches):
            assert (a.offset, a._idx) == (b.offset, b._idx)
            assert raw(a.keys).tobytes() == raw(b.keys).tobytes() and raw(a.values).tobytes() == raw(b.values).tobytes()
            nxt = kv(1, 1, 999, **DIMS)
            assert [raw(x).tobytes() for x in a.update_and_fetch(*nxt)] == \
                [raw(x).tobytes() for x in b.update_and_fetch(*nxt)]
