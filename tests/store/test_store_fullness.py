"""A full disk never blocks reads or deletes (issue 12), on a REAL filesystem filled to its last byte.

Each test mounts a small tmpfs (marked ``host_feature("mount")``: skipped, with the reason, where mount is refused), fills it with a ballast file
until a one-byte write fails, and checks: restores from a fresh handle (whose lease file has no room) are bit-exact,
a reader protected by object locks keeps its objects from another process's delete + gc, a delete of a long
session fits the reserve even on a compacted index (no reusable LMDB pages), a delete without any reserve first
frees dead objects, gc works, a save is a clean ``StoreFull`` that leaves nothing behind, and once the ballast goes
everything verifies and restores bit-exact. The reserve's sizing is measured against LMDB itself.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import store_workers as sw
from host_features import need
from kvshelf.errors import StoreFull
from kvshelf.latent_legos import LatentGeometry, MLACache
from kvshelf.store.space import reserve
from kvshelf.store.liveness.object_locks import LeasedObjects
from kvshelf.store.objects.pack import new_pack_name
from kvshelf.tools import lmdb_files

LONG = 20_000  # tokens of a "long" session: ~1 250 prefix records with random keys


@pytest.fixture
def tmpfs(tmp_path: Path):
    mounted: list[Path] = []

    def make(size: str) -> Path:
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        need("mount")  # the tests that mount are marked host_feature("mount")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"mount -t tmpfs failed although the probe mounted one: {done.stderr.strip()}"
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def free_bytes(path: Path) -> int:
    st_ = os.statvfs(path)
    return st_.f_bavail * st_.f_frsize


def fill(where: Path) -> Path:
    """A ballast file taking every free byte of the filesystem: writes halve down to one byte until ENOSPC."""
    ballast = where / "ballast"
    size = 1 << 20
    with open(ballast, "ab", buffering=0) as f:
        while size:
            try:
                f.write(b"\xa5" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                size //= 2
    assert free_bytes(where) == 0
    return ballast


def save(store, session: str, length: int):
    return store.save(session, sw.session_tokens(session, length), sw.build_caches(session, length))


def check(store, saved: dict[str, int]) -> None:
    for session, length in saved.items():
        r = store.restore(session)
        assert list(r.tokens) == sw.session_tokens(session, length)
        assert sw.mismatch(r.caches, session, length) is None


def long_caches(i: int, length: int = LONG) -> list:
    cache = MLACache(LatentGeometry(kv_lora_rank=4, rope_head_dim=4))
    ramp = (mx.arange(length, dtype=mx.float32).reshape(1, length, 1) + i * LONG) * mx.ones((1, 1, 4))
    cache.append_latent(ramp, -ramp, None)
    mx.eval(cache.state)
    return [cache]


def long_tokens(i: int) -> list[int]:
    return [i * 1_000_000 + j for j in range(LONG)]


def check_long(store, session: str, i: int) -> None:
    r = store.restore(session)
    assert list(r.tokens) == long_tokens(i)
    latent, rope = (np.array(a) for a in r.caches[0].state[:2])
    want = np.repeat((np.arange(LONG, dtype=np.float32) + i * LONG).reshape(1, LONG, 1), 4, axis=2)
    assert np.array_equal(latent, want) and np.array_equal(rope, -want)


def compact_index(store) -> None:
    """The index rewritten by a compacting copy: its free list is empty, so every page a commit writes is new."""
    with store.admin.exclusive():
        copy = lmdb_files.compact_copy(store.admin.copy_index, os.path.join(store.root, "tmp"))
        store.admin.replace_index(lambda index_dir: lmdb_files.swap_in(copy, index_dir))


def leftovers(store_dir: Path) -> list[str]:
    return sorted(os.listdir(store_dir / "tmp"))


def pack_of(store, session: str) -> Path:
    m = store.admin.manifest(store.sessions()[[s.session_id for s in store.sessions()].index(session)].snapshot_id)
    return Path(store.bytes.path(store.admin.summaries()[m.snapshot_id].pack))


@pytest.mark.host_feature("mount")
def test_full_disk_serves_restores_and_refuses_saves_cleanly(tmpfs) -> None:
    mnt = tmpfs("6m")
    store_dir = mnt / "store"
    saved = {"f0-a": 560, "f1-b": 420, "f2-c": 300}
    with sw.open_test_store(store_dir) as store:
        for session, length in saved.items():
            save(store, session, length)
    reserve.release(str(store_dir))  # too full even for the reserve: it is gone and the disk is full
    ballast = fill(mnt)
    with sw.open_test_store(store_dir) as store:  # a fresh handle: its lease file gets no room
        assert reserve.held(str(store_dir)) == 0
        check(store, saved)
        batch = store.restore_batch(["f0-a", "f1-b"])
        assert batch is not None
        packs = sorted(os.listdir(store_dir / "packs"))
        with pytest.raises(StoreFull):
            save(store, "f0-new", 560)
        assert leftovers(store_dir) == [] and sorted(os.listdir(store_dir / "packs")) == packs
        assert store.verify(deep=True) == []
        store.gc(dry_run=False)  # nothing to collect; must not fail on the full disk
        check(store, saved)
    ballast.unlink()
    with sw.open_test_store(store_dir) as store:
        assert store.verify(deep=True) == []
        check(store, saved)
        save(store, "f0-new", 560)
        saved["f0-new"] = 560
        check(store, saved)
        assert reserve.held(str(store_dir)) >= reserve.RESERVE_BYTES  # taken back once there was room


def _long_store(store_dir: Path, n: int = 10) -> None:
    with sw.open_test_store(store_dir) as store:
        for i in range(n):
            store.save(f"long-{i}", long_tokens(i), long_caches(i))
        save(store, "f0-small", 300)
        compact_index(store)


@pytest.mark.host_feature("mount")
def test_delete_of_a_long_session_fits_the_reserve_on_a_full_disk(tmpfs) -> None:
    """A compacted index has no reusable pages: deleting one of ten 20k-token sessions needs ~3 MiB of new pages,
    six times the old fixed 512 KiB reserve. The reserve is sized for it, so the delete and a gc go through."""
    mnt = tmpfs("48m")
    store_dir = mnt / "store"
    _long_store(store_dir)
    with sw.open_test_store(store_dir) as store:
        assert reserve.held(str(store_dir)) > reserve.RESERVE_BYTES
        victim = pack_of(store, "long-0")
        ballast = fill(mnt)
        store.delete("long-0")
        assert not victim.exists()
        assert free_bytes(mnt) > 0  # the pack's blocks, net of the pages the commit took and the reserve retaken
        store.gc(dry_run=False)
        check_long(store, "long-1", 1)
        check(store, {"f0-small": 300})
        assert [s.session_id for s in store.sessions()].count("long-0") == 0
    ballast.unlink()
    with sw.open_test_store(store_dir) as store:
        assert store.verify(deep=True) == []
        for i in range(1, 10):
            check_long(store, f"long-{i}", i)


@pytest.mark.host_feature("mount")
def test_without_a_reserve_a_delete_first_frees_what_is_dead(tmpfs) -> None:
    """No reserve at all and no reusable page: the delete first removes crash residue (an unindexed pack no lease
    or lock holds, as a killed save leaves), then commits; nothing live is touched."""
    mnt = tmpfs("48m")
    store_dir = mnt / "store"
    _long_store(store_dir)
    with sw.open_test_store(store_dir) as store:
        live = pack_of(store, "long-1")
        residue = store_dir / new_pack_name()
        shutil.copyfile(live, residue)  # not in the index: dead by construction, exactly what gc removes
        extra = store_dir / new_pack_name()
        shutil.copyfile(live, extra)
        with open(extra, "ab") as f:
            f.write(b"\0" * (4 << 20))  # enough dead bytes for the commit
        reserve.release(str(store_dir))
        ballast = fill(mnt)
        store.delete("long-0")
        assert not residue.exists() and not extra.exists()
        check_long(store, "long-1", 1)
    ballast.unlink()
    with sw.open_test_store(store_dir) as store:
        assert store.verify(deep=True) == []
        assert "long-0" not in [s.session_id for s in store.sessions()]
        for i in range(1, 10):
            check_long(store, f"long-{i}", i)


_DELETER = """
import sys
sys.path.insert(0, {helpers!r})
import store_workers as sw
with sw.open_test_store({store!r}) as s:
    s.delete({session!r})
    s.gc(dry_run=False)
print("deleted")
"""


@pytest.mark.host_feature("mount")
def test_a_reader_on_a_full_disk_keeps_its_objects_from_another_process(tmpfs) -> None:
    """The lease cannot be published, so the reader locks its objects; another process deletes the session and
    runs gc meanwhile: the objects stay, byte for byte, until the reader lets go; then gc takes them."""
    mnt = tmpfs("6m")
    store_dir = mnt / "store"
    with sw.open_test_store(store_dir) as store:
        save(store, "f0-read", 560)
        save(store, "f1-keep", 300)
    ballast = fill(mnt)  # the reserve stays: the deleter needs it; the reader's fresh lease file gets no room
    with sw.open_test_store(store_dir) as store:
        m = store.admin.manifest(store.sessions()[[s.session_id for s in store.sessions()].index("f0-read")].snapshot_id)
        own = pack_of(store, "f0-read")
        before = own.read_bytes()
        with store.admin.lease(m):
            assert store.admin.leased_hashes() >= {r.hash for r in m.all_chunks}  # this handle sees its in-memory lease
            done = subprocess.run([sys.executable, "-c", _DELETER.format(helpers=str(Path(sw.__file__).parent),
                                                                        store=str(store_dir), session="f0-read")],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            assert own.exists(), "a reader's locked pack was unlinked by another process's delete + gc"
            assert own.read_bytes() == before  # every byte the reader located is still there to read
        assert store.gc(dry_run=False).orphan_objects or not own.exists()
        assert not own.exists()
        check(store, {"f1-keep": 300})
    ballast.unlink()
    with sw.open_test_store(store_dir) as store:
        assert store.verify(deep=True) == []


def test_reserve_covers_the_pages_a_delete_allocates(tmp_path: Path) -> None:
    """The figure behind ``reserve.needed_bytes``: LMDB pages a delete allocates past the end of a compacted index
    (no free list to reuse), for ten 20k-token sessions; the bound must cover it and the old 512 KiB must not."""
    store_dir = tmp_path / "store"
    _long_store(store_dir)
    with sw.open_test_store(store_dir) as store:
        env = store.index.env
        psize = env.stat()["psize"]
        bound = reserve.needed_bytes(store.index, LONG)
        before = env.info()["last_pgno"]
        store.delete("long-0")
        allocated = (env.info()["last_pgno"] - before) * psize
    print(f"\ndelete of a {LONG}-token session among 10: {allocated} bytes of new pages, reserve bound {bound}")
    assert allocated > reserve.RESERVE_BYTES
    assert bound >= allocated


names = st.sets(st.sampled_from([f"packs/{c}.pack" for c in "abcdefgh"]), max_size=8)


@given(names, names, names, st.sampled_from([f"packs/{c}.pack" for c in "abcdefghij"]))
def test_leased_objects_answer_for_leases_locks_and_unions(leased, locked, other, name) -> None:
    """Whatever the sets: membership after any union is leased ∪ other ∪ locked, as the unlinkers' code asks it."""
    held = LeasedObjects(leased, locked.__contains__)
    want = name in leased or name in other or name in locked
    assert (name in (held | other)) == want
    assert (name in (other | held)) == want
    assert (name in held.copy()) == (name in leased or name in locked)
    assert set(held | other) == leased | other  # iteration: the published names only
    assert (name in LeasedObjects(leased)) == (name in leased)



@pytest.mark.host_feature("mount")
def test_copying_the_index_on_a_full_disk_is_store_full(tmpfs) -> None:
    """``copy_index`` (compaction's index step) on a full disk: LMDB's DiskError leaves as ``StoreFull``, the store
    unchanged — never a raw ``lmdb`` error."""
    mnt = tmpfs("6m")
    store_dir = mnt / "store"
    saved = {"f0-a": 560}
    with sw.open_test_store(store_dir) as store:
        save(store, "f0-a", 560)
        (mnt / "index-copy").mkdir()
        reserve.release(str(store_dir))
        ballast = fill(mnt)
        with store.admin.exclusive():
            with pytest.raises(StoreFull):
                store.admin.copy_index(str(mnt / "index-copy"))
        check(store, saved)
    ballast.unlink()
