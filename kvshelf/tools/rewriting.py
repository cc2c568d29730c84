"""Compaction's rewriting: a snapshot's arrays read from its chunks, new chunks built and swapped in.

Why its own file: ``compaction.py`` had grown past the size limit holding two concerns, *which* snapshots and chunks
each step takes (the plan, the order, leases, dry-run accounting, the report) and *how* a snapshot is rewritten at the
chunk level (dense block tables, merged chunks, zstd estimates). The plan lives in ``compaction.py``; everything here
works on one snapshot or chunk it is handed and changes the store only through ``store.admin.replace_snapshot`` (``swap``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from ..errors import CorruptData, KvShelfError
from ..store import Store
from ..store.admin import (KVZ_MAGIC, Destinations, Piece, content_hash, fill_from_chunk, kvz_buffers, plan_chunks,
                           storage_dtype)
from ..store.index import ChunkRef, Manifest
from .densify import densify, dropped_blocks

ZSTD_LEVEL = 3  # what the store's .kvz writer uses by default


# --- reading and writing snapshots at the chunk level ------------------------------------------------------------------
def read_snapshot(store: Store, manifest: Manifest) -> list[list]:
    """Every array of a snapshot, read and verified from its chunks (no codec, no cache object)."""
    dest = Destinations(list(manifest.entries))
    for ref in manifest.all_chunks:
        with store.admin.open_chunk(ref.hash, verify=True) as reader:
            fill_from_chunk(reader, ref, dest)
    return dest.finish()


def swap(store: Store, old: Manifest, new: Manifest, todo: list[tuple[ChunkRef, list[Piece]]]) -> None:
    """Write the new chunks and swap the manifest (``store.admin.replace_snapshot``: save gate held, old chunks leased across
    the swap and left for a later ``gc``). A snapshot replaced or removed meanwhile raises ``Lost``."""
    if not store.admin.replace_snapshot(old, new, todo):
        raise Lost(f"snapshot {old.snapshot_id} of session {old.session_id!r} was saved again, removed or rewritten "
                    f"while it was being compacted; left as it is")


class Lost(KvShelfError):
    pass


# --- step 2: dense block tables -------------------------------------------------------------------------------------
def densify_one(store: Store, m: Manifest, dry_run: bool) -> tuple[int, int]:
    """(bytes before, after) of the snapshot's untokened chunks."""
    before = sum(r.nbytes for r in m.own)
    if dry_run:
        after = 0
        for e in m.entries:
            for slot in e.tensors:
                if slot.token_axis is None:
                    keep = (e.pages.num_blocks - dropped_blocks(e)) if e.pages and e.pages.num_blocks else 1
                    total = e.pages.num_blocks if e.pages and e.pages.num_blocks else 1
                    after += slot.nbytes * keep // total
        return before, after
    arrays = read_snapshot(store, m)
    pairs = [densify(e, a) for e, a in zip(m.entries, arrays)]
    entries, new_arrays = [p[0] for p in pairs], [p[1] for p in pairs]
    plans = plan_chunks(entries, new_arrays, m.chunk_tokens)
    chunks, own, todo = [], [], []
    for plan in plans:
        ref = ChunkRef(content_hash(plan.pieces), plan.start, plan.stop, sum(p.nbytes for p in plan.pieces))
        (own if plan.stop == 0 else chunks).append(ref)
        todo.append((ref, plan.pieces))
    new = msgspec.structs.replace(m, entries=entries, chunks=chunks, own=own)
    swap(store, m, new, todo)
    return before, sum(r.nbytes for r in own)


# --- step 3: merging undersized chunks --------------------------------------------------------------------------------
def merge_plan(m: Manifest, refs_of: Callable[[str], int], leased: set[str]) -> list[list[ChunkRef]]:
    """Runs of consecutive chunks to merge: each holds an undersized chunk (fewer than ``chunk_tokens`` tokens),
    only chunks no other snapshot references, at most ``2 * chunk_tokens`` tokens in all."""
    bins: list[list[ChunkRef]] = []
    current: list[ChunkRef] = []

    def small(r: ChunkRef) -> bool:
        return r.stop - r.start < m.chunk_tokens

    for ref in m.chunks:
        eligible = refs_of(ref.hash) == 1 and ref.hash not in leased
        if (current and eligible and (small(ref) or small(current[-1]))
                and ref.stop - current[0].start <= 2 * m.chunk_tokens):
            current.append(ref)
            continue
        if len(current) > 1:
            bins.append(current)
        current = [ref] if eligible else []
    if len(current) > 1:
        bins.append(current)
    return bins


def _merged_pieces(store: Store, m: Manifest, group: list[ChunkRef]) -> list[Piece]:
    parts: dict[str, list[np.ndarray]] = {}
    meta: dict[str, tuple[str, int]] = {}
    for ref in group:
        with store.admin.open_chunk(ref.hash, verify=True) as reader:
            bufs = reader.read_into([None] * len(reader.tensors))
            for t, buf in zip(reader.tensors, bufs):
                i, j = (int(x) for x in t.name.split(".", 2)[:2])
                axis = m.entries[i].tensors[j].token_axis
                if axis is None:
                    raise CorruptData(f"chunk {ref.hash}: tensor {t.name!r} has no token axis")
                parts.setdefault(t.name, []).append(np.frombuffer(buf, storage_dtype(t.dtype)).reshape(t.shape))
                meta[t.name] = (t.dtype, axis)
    pieces = []
    for name, arrays in parts.items():
        if len(arrays) != len(group):
            raise CorruptData(f"chunks {[r.hash for r in group]} do not all hold tensor {name!r}")
        dtype, axis = meta[name]
        joined = np.ascontiguousarray(np.concatenate(arrays, axis=axis))
        pieces.append(Piece(name, dtype, tuple(joined.shape), memoryview(joined).cast("B")))
    return pieces


def merge_one(store: Store, m: Manifest, bins: list[list[ChunkRef]]) -> None:
    replacement: dict[str, ChunkRef] = {}
    todo = []
    for group in bins:
        pieces = _merged_pieces(store, m, group)
        ref = ChunkRef(content_hash(pieces), group[0].start, group[-1].stop, sum(r.nbytes for r in group))
        todo.append((ref, pieces))
        replacement[group[0].hash] = ref
        for r in group[1:]:
            replacement[r.hash] = None  # type: ignore[assignment]
    chunks = []
    for r in m.chunks:
        if r.hash not in replacement:
            chunks.append(r)
        elif replacement[r.hash] is not None:
            chunks.append(replacement[r.hash])
    new = msgspec.structs.replace(m, chunks=chunks)
    swap(store, m, new, todo)


# --- step 4: recompression ---------------------------------------------------------------------------------------
def estimate_zstd(store: Store, hash_: str, level: int = ZSTD_LEVEL) -> int:
    """The bytes a chunk's frame would take stored as zstd (for ``--dry-run``): the very frame the recompression
    would write (``kvz_buffers``: byte-shuffled float planes, then zstd), measured, never written."""
    with store.admin.open_chunk(hash_, verify=False) as reader:
        bufs = reader.read_into([None] * len(reader.tensors))
        pieces = [Piece(t.name, t.dtype, t.shape, b) for t, b in zip(reader.tensors, bufs)]
        return sum(len(b) for b in kvz_buffers(pieces, dict(reader.metadata), level))


def raw_overhead(store: Store, hash_: str) -> int:
    """The bytes of a chunk's safetensors framing (its raw file = framing + payload), for ``--dry-run``."""
    with store.admin.open_chunk(hash_, verify=False) as reader:
        return reader.data_start - reader.base - (len(KVZ_MAGIC) if reader.compressed else 0)


__all__ = ["Lost", "ZSTD_LEVEL", "densify_one", "estimate_zstd", "merge_one", "merge_plan", "raw_overhead", "read_snapshot",
           "swap"]
