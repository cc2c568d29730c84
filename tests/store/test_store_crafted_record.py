"""A manifest record that passes its checksum but whose shapes lie (crafted, or written by a buggy writer) is refused
before any destination is allocated (issue 12: "restore validates entries, and Σ slot bytes = Σ chunk bytes, before
allocating"): the entries are validated by their codec, and each destination's declared bytes are compared with
what its chunks' headers say they hold. Other sessions keep restoring exactly.
"""

from __future__ import annotations

import msgspec
import pytest
from tools_data import MODEL, make_caches, same_reads

from kvshelf import open_store
from kvshelf.errors import CorruptData
from kvshelf.store.index import schema as mf

N = 40


def _craft(store, snapshot_id: str, change) -> None:
    """Replace the indexed manifest by ``change(manifest)``, sealed like a real record (its checksum is valid)."""
    m = store.admin.manifest(snapshot_id)
    new = change(m)
    store.index.write(lambda txn: txn.put("manifests", bytes.fromhex(snapshot_id), mf.encode(new)))


def _with_slot(m, **fields):
    e = m.entries[0]
    t = e.tensors[0]
    slot = msgspec.structs.replace(t, **fields)
    entry = msgspec.structs.replace(e, tensors=[slot, *e.tensors[1:]])
    return msgspec.structs.replace(m, entries=[entry, *m.entries[1:]])


@pytest.mark.parametrize("lie", ["dtype", "huge-token-axis", "shorter", "chunk-list-short"])
def test_a_record_whose_shapes_lie_is_corrupt_before_allocation(tmp_path, lie) -> None:
    caches, other = make_caches("mla", N, 1), make_caches("mla", N, 2)
    with open_store(tmp_path / "s", identity=MODEL, chunk_tokens=16) as store:
        info = store.save("a", list(range(N)), caches)
        store.save("b", list(range(1000, 1000 + N)), other)
        t = store.admin.manifest(info.snapshot_id).entries[0].tensors[0]
        axis = t.token_axis
        if lie == "dtype":  # same shape, half the bytes: a float16 destination filled from float32 chunks
            change = lambda m: _with_slot(m, dtype="float16", nbytes=t.nbytes // 2)  # noqa: E731
        elif lie == "huge-token-axis":  # 2^32 positions: tens of GiB if anything were allocated from it
            shape = list(t.shape)
            shape[axis] = 1 << 32
            change = lambda m: _with_slot(m, shape=shape, nbytes=t.nbytes // t.shape[axis] << 32)  # noqa: E731
        elif lie == "chunk-list-short":  # entries intact, one chunk ref gone: the slots' bytes are not covered
            change = lambda m: msgspec.structs.replace(m, chunks=m.chunks[:-1])  # noqa: E731
        else:
            shape = list(t.shape)
            shape[axis] -= 3
            change = lambda m: _with_slot(m, shape=shape, nbytes=t.nbytes // t.shape[axis] * shape[axis])  # noqa: E731
        _craft(store, info.snapshot_id, change)
        with pytest.raises(CorruptData, match="does not match its chunks" if lie == "chunk-list-short" else "session .a."):
            store.restore("a")
        assert same_reads(store.restore("b").caches, other)


@pytest.mark.parametrize("lie", ["huge-consistent-offset", "chunk-list-short"])
def test_a_batched_restore_checks_coverage_before_allocating(tmp_path, lie) -> None:
    """``restore_batch`` checks each row as a single-row restore does before its batch destinations exist. The
    lies pass the codecs' ``validate`` (the entry agrees with itself), so only the chunk-bytes check can catch them:
    2^20 declared positions would make the batch allocate 768 MiB (and return zeros), a missing chunk ref would
    return a silently zero-filled row. MLX's peak memory counts what was allocated."""
    import mlx.core as mx

    caches, other = make_caches("mla", N, 1), make_caches("mla", N, 2)
    with open_store(tmp_path / "s", identity=MODEL, chunk_tokens=16) as store:
        info = store.save("a", list(range(N)), caches)
        store.save("b", list(range(1000, 1000 + N)), other)
        if lie == "huge-consistent-offset":
            big = 1 << 20

            def change(m):
                e = m.entries[0]
                slots = [msgspec.structs.replace(t, shape=[1, big, 32], nbytes=big * 32 * 4) for t in e.tensors]
                return msgspec.structs.replace(m, entries=[msgspec.structs.replace(e, offset=big, tensors=slots),
                                                           *m.entries[1:]])
        else:
            change = lambda m: msgspec.structs.replace(m, chunks=m.chunks[:-1])  # noqa: E731
        _craft(store, info.snapshot_id, change)
        mx.eval(mx.zeros((1,)))
        mx.reset_peak_memory()
        with pytest.raises(CorruptData, match="does not match its chunks"):
            store.restore_batch(["b", "a"])
        assert mx.get_peak_memory() < 1 << 20  # nothing of the batch was allocated (one row alone is 30 KiB)
        batch = store.restore_batch(["b", "b"])  # the other session is untouched, its leases released
        assert batch.lengths == [N, N]
        assert same_reads(store.restore("b").caches, other)
