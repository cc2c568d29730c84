"""Lossless compaction of a store: smaller files, fewer files, a smaller index — every restore bit-identical.

Steps, in order (each reported with its count and bytes before/after; ``dry_run`` computes the plan only):

1. ``orphans``    remove crash residue (unindexed packs and v1 chunk files, manifest files, dead tmp files) — ``Store.gc``.
2. ``densify``    paged snapshots whose pools hold blocks no page uses get a dense block table (``densify.py``).
3. ``merge``      runs of undersized chunks of one snapshot that no other snapshot shares become one chunk.
4. ``recompress`` raw chunks not used for ``cold_after`` seconds are stored as zstd (at ``level``) over byte-shuffled
                  float planes (``store.admin.rewrite_chunk``: same content hash, the reader handles both); a chunk that does
                  not shrink goes back to raw. Hot chunks stay raw for zero-copy restores.
   ``decompress`` zstd chunks used within the last ``cold_after`` seconds (hot again) go back to raw — only within
                  the space this run has already given back: compaction never ends with a bigger store.
5. ``repack``     v1 chunk files and the packs whose rewrite ends smaller (dead chunks, a replaced snapshot's
                  manifest: ``admin.reclaimable_packs``) are rewritten into fresh packs (same bytes, same hashes; the
                  emptied objects go once no reader leases them). An all-live pack is never rewritten, so a second
                  compact changes nothing.
6. ``release``    chunks that steps 2-3 replaced are removed, at least ``grace`` seconds after the last swap.
7. ``index``      the LMDB file is rewritten by a compacting copy and swapped in atomically — only while this handle
                  holds the store alone (``store.admin.exclusive``: the open lock says no other process has it open);
                  otherwise skipped with the reason.

Safe beside serving processes: a snapshot is rewritten by ``store.admin.replace_snapshot`` — new chunks written under the
save gate, then one LMDB transaction swaps the manifest (same snapshot id) after re-checking that the snapshot is
still its session's latest and unchanged (a save that won the race keeps its snapshot; the rewrite is skipped and
its chunks unlinked). Snapshots a live reader holds (leases) are skipped; the old chunks are leased across the swap, so
a reader that fetched the old manifest just before it still finds every chunk it names, and they are only unlinked by
the ``gc`` of step 5, ``grace`` seconds later. Only the store's public surface is used.

This module is the plan (which snapshots and chunks each step takes, in what order, around which leases, and the
report); how one snapshot is rewritten at the chunk level (dense tables, merged chunks, zstd estimates) is
``rewriting.py``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import CorruptData, KvShelfError, SnapshotNotFound
from ..store import Store, StoreBusy
from ..store.admin import REWRITE_OVERHEAD
from ..store.index import Manifest
from . import lmdb_files
from .densify import is_dense
from .rewriting import (ZSTD_LEVEL, Lost, densify_one, estimate_zstd, merge_one, merge_plan, raw_overhead,
                        read_snapshot)

LEASE_RETRIES = (0.05, 0.1, 0.2, 0.4)  # seconds before leased snapshots are tried again


@dataclass
class CompactionStep:
    name: str
    count: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    items: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class CompactionReport:
    """What compaction did (or, with ``dry_run``, would do). Bytes are on-disk bytes of chunks + index."""

    dry_run: bool
    steps: list[CompactionStep]
    bytes_before: int
    bytes_after: int
    seconds: float
    skipped_leased: int  # snapshots (densify) and chunks (recompress) passed over because a live reader held them

    @property
    def ratio(self) -> float:
        return self.bytes_before / self.bytes_after if self.bytes_after else 1.0

    def step(self, name: str) -> CompactionStep:
        return next(s for s in self.steps if s.name == name)


def _disk_bytes(store: Store) -> int:
    return sum(size for _name, size in store.admin.stored_objects()) + lmdb_files.index_bytes(store.root)


def _leased(store: Store, manifest: Manifest, leased: set[str]) -> bool:
    return any(r.hash in leased for r in manifest.all_chunks)


# --- step 2: dense block tables (the rewrite itself: rewriting.py) ----------------------------------------------
def _densify_into(store: Store, m: Manifest, dry_run: bool, step: CompactionStep) -> None:
    try:
        before, after = densify_one(store, m, dry_run)
    except (SnapshotNotFound, CorruptData, Lost) as exc:  # replaced, evicted or quarantined meanwhile
        step.skipped.append(f"{m.snapshot_id}: {exc}")
        return
    step.count += 1
    step.bytes_before += before
    step.bytes_after += after
    step.items.append(m.snapshot_id)


def _current(store: Store, m: Manifest) -> Manifest | None:
    try:
        return store.admin.manifest(m.snapshot_id)
    except SnapshotNotFound:
        return None


# --- the job -----------------------------------------------------------------------------------------------------
def compact(store: Store, cold_after: float = 3600.0, dry_run: bool = False, *, grace: float = 2.0,
            merge: bool = True, densify_pages: bool = True, compact_index: bool = True, level: int = ZSTD_LEVEL,
            log: Callable[[str], None] = lambda _m: None, clock: Callable[[], float] = time.time) -> CompactionReport:
    """Compact ``store`` losslessly (see the module docstring); ``cold_after`` in seconds (0: every chunk is cold);
    ``level``: the zstd level cold chunks are written at (1-22); ``clock``: "now" for a chunk's age, in seconds
    (a test fixes it instead of waiting for chunks to age)."""
    if not isinstance(level, int) or not 1 <= level <= 22:
        raise ValueError(f"zstd level must be an int in 1..22, got {level!r}")
    if not dry_run:  # refused before the first step, under this job's name (not that of the first write, gc)
        store.admin.check_writable("compact")
    started = time.perf_counter()
    bytes_before = _disk_bytes(store)
    steps: list[CompactionStep] = []
    skipped_leased: set[str] = set()

    # 1. orphans
    gc = store.gc(dry_run=dry_run)
    steps.append(CompactionStep("orphans", len(gc.orphan_objects) + len(gc.orphan_manifests), gc.bytes, 0,
                                gc.orphan_objects, note=gc.skipped))

    # 2. dense block tables
    step = CompactionStep("densify")
    steps.append(step)
    last_swap = None
    if densify_pages:
        todo = [m for m in store.admin.iter_manifests() if not all(is_dense(e) for e in m.entries)]
        for attempt in range(len(LEASE_RETRIES) + 1):  # a reader's lease lasts milliseconds: try leased ones again
            if attempt:
                time.sleep(LEASE_RETRIES[attempt - 1])
                todo = [_current(store, m) for m in todo]
                todo = [m for m in todo if m is not None]
            leased, later = store.admin.leased_hashes(), []
            for m in todo:
                if _leased(store, m, leased):
                    later.append(m)
                    continue
                _densify_into(store, m, dry_run, step)
            todo = later
            if not todo:
                break
        for m in todo:
            step.skipped.append(m.snapshot_id)
            skipped_leased.add(m.snapshot_id)
        if step.count and not dry_run:
            last_swap = time.monotonic()

    # 3. merge undersized chunks
    step = CompactionStep("merge")
    steps.append(step)
    if merge:
        refs = {h: meta.refs for h, meta in store.admin.iter_chunks()}
        leased = store.admin.leased_hashes()
        for m in store.admin.iter_manifests():
            bins = merge_plan(m, lambda h: refs.get(h, 0), leased)
            if not bins:
                continue
            merged = sum(len(b) for b in bins)
            try:
                if not dry_run:
                    merge_one(store, m, bins)
                    last_swap = time.monotonic()
            except (SnapshotNotFound, CorruptData, Lost) as exc:
                step.skipped.append(f"{m.snapshot_id}: {exc}")
                continue
            step.count += merged - len(bins)  # files saved
            step.bytes_before += sum(r.nbytes for b in bins for r in b)
            step.bytes_after += sum(r.nbytes for b in bins for r in b)
            step.items.append(m.snapshot_id)

    # 4. recompress cold chunks; chunks that became hot again go back to raw (zero-copy restores)
    step = CompactionStep("recompress")
    steps.append(step)
    hot = CompactionStep("decompress")
    now_ns = int(clock() * 1e9)
    leased = store.admin.leased_hashes()
    leased_chunks = 0
    # decompressing a hot chunk makes the store bigger: it may spend only what this run has given back so far
    budget = 0 if dry_run else bytes_before - _disk_bytes(store)
    for h, meta in list(store.admin.iter_chunks()):
        cold = (now_ns - meta.last_used_ns) / 1e9 >= cold_after
        target = step if cold and meta.encoding == "raw" else hot if not cold and meta.encoding == "zstd" else None
        if target is None:
            continue
        if h in leased:
            target.skipped.append(h)
            leased_chunks += 1
            continue
        if target is hot:
            growth = meta.nbytes + raw_overhead(store, h) + REWRITE_OVERHEAD
            if growth > budget:
                hot.skipped.append(f"{h}: stays zstd (raw would make the store bigger)")
                continue
            budget -= growth
        try:
            if target is hot:
                after = meta.nbytes + raw_overhead(store, h) if dry_run else store.admin.rewrite_chunk(h, "raw")
            else:
                after = estimate_zstd(store, h, level)  # the plan: only a chunk that shrinks is rewritten
                if after + REWRITE_OVERHEAD // 16 >= meta.stored_bytes:
                    continue
                if not dry_run:
                    after = store.admin.rewrite_chunk(h, "zstd", level=level)
                    if after is not None and after >= meta.stored_bytes:  # incompressible after all: zero-copy form
                        store.admin.rewrite_chunk(h, "raw")
                        continue
            if after is None:
                continue
        except (CorruptData, FileNotFoundError) as exc:
            target.skipped.append(f"{h}: {exc}")
            continue
        target.count += 1
        target.bytes_before += meta.stored_bytes
        target.bytes_after += after
        target.items.append(h)
    steps.append(hot)

    # 5. repack: v1 chunk files and packs whose live ratio fell under MIN_LIVE_RATIO into fresh packs
    steps.append(_repack(store, dry_run))

    # 6. release what steps 2-3 replaced
    step = CompactionStep("release")
    steps.append(step)
    if not dry_run and last_swap is not None:
        wait = grace - (time.monotonic() - last_swap)
        if wait > 0:
            time.sleep(wait)
        released = store.gc(dry_run=False)
        step.count, step.bytes_before = len(released.orphan_objects), released.bytes
        step.items = released.orphan_objects
        step.note = released.skipped

    # 7. the index file
    steps.append(_compact_index(store, dry_run) if compact_index else CompactionStep("index", note="disabled"))

    bytes_after = _disk_bytes(store)
    if dry_run:
        bytes_after = bytes_before - sum(s.bytes_before - s.bytes_after for s in steps)
    return CompactionReport(dry_run, steps, bytes_before, bytes_after, round(time.perf_counter() - started, 3),
                            len(skipped_leased) + leased_chunks)


MIN_LIVE_RATIO = 0.5


def _repack(store: Store, dry_run: bool) -> CompactionStep:
    """``store.admin.repack`` of what ends smaller: every v1 chunk file (into packs: one file instead of one per chunk)
    and every pack whose rewrite gives back more than it costs (``admin.reclaimable_packs``: dead chunks, a
    replaced snapshot's manifest); the emptied objects go once no reader holds them. A pack that is all live is
    never rewritten, so a second compact finds nothing to do."""
    step = CompactionStep("repack")
    packs = dict(store.admin.iter_packs())
    gains = store.admin.reclaimable_packs()
    v1 = [(h, m) for h, m in store.admin.iter_chunks() if not m.pack]
    if not gains and not v1:
        return step
    todo = v1 + [(h, m) for h, m in store.admin.iter_chunks() if m.pack in gains]
    step.bytes_before = sum(m.stored_bytes for _h, m in v1) + sum(packs[n].size for n in gains)
    if dry_run:
        step.count = len(todo)
        step.bytes_after = step.bytes_before - sum(gains.values())
        return step
    before = _disk_bytes(store)
    done = store.admin.repack(packs=set(gains), v1=bool(v1))
    step.count = done["chunks_moved"]
    after = _disk_bytes(store)
    step.bytes_after = max(0, step.bytes_before - (before - after))
    step.note = f"{done['objects_emptied']} object(s) emptied"
    return step


def _compact_index(store: Store, dry_run: bool) -> CompactionStep:
    """Shrink the LMDB file by a compacting copy swapped in — only while this handle holds the store alone
    (``store.admin.exclusive``: no other process or handle has it open); otherwise skipped with the reason."""
    step = CompactionStep("index")
    data = os.path.join(store.root, "index", "data.mdb")
    step.bytes_before = step.bytes_after = os.stat(data).st_size
    if dry_run and store.read_only:
        return _measure_index(store, step)
    try:
        with store.admin.exclusive():
            copy = lmdb_files.compact_copy(store.admin.copy_index, os.path.join(store.root, "tmp"))
            step.bytes_after = os.stat(copy).st_size
            if dry_run or step.bytes_after >= step.bytes_before:
                lmdb_files.discard(copy)
                if not dry_run:
                    step.bytes_after = step.bytes_before
                    step.note = "already compact"
                return step
            store.admin.replace_index(lambda index_dir: lmdb_files.swap_in(copy, index_dir))
    except StoreBusy as exc:
        step.bytes_after = step.bytes_before
        step.note = f"skipped: {exc}"
        return step
    step.count = 1
    return step


def _measure_index(store: Store, step: CompactionStep) -> CompactionStep:
    """The index step of a dry run on a store this process may only read: no exclusive hold (it is a write lock,
    and the owner's compact takes it) and no copy inside the store (its ``tmp`` is not writable): the compacting
    copy is measured in a private temporary directory outside it and removed."""
    try:
        with tempfile.TemporaryDirectory(prefix="kvshelf-compact-") as work:
            step.bytes_after = min(step.bytes_before, store.admin.compacted_index_size(work))
    except KvShelfError as exc:  # e.g. no room for the copy in the temporary directory: the plan says so
        step.note = f"not measured: {exc}"
        return step
    step.note = "read-only store: measured on a private copy; the owner's compact swaps it in"
    return step


__all__ = ["compact", "CompactionReport", "CompactionStep", "merge_plan", "read_snapshot", "estimate_zstd"]
