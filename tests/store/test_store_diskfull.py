"""Disk full: a save that meets ENOSPC raises ``StoreFull``, commits nothing, and leaves every earlier snapshot intact.

Two ways to run out of space: a real 4 MiB tmpfs mounted for the test (needs the right to mount; skipped with the
reason when the machine refuses), and the blob writer's fault-injection seam (``kvshelf.store.base.seams.FAULT_HOOK``),
which always runs. Both then check the same things: the error names the failure clearly, the index verifies clean
(also after reopening), earlier sessions restore bit-exact, the failed session is absent or still its old self,
and once space is freed the same save succeeds.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

import store_workers as sw
from host_features import need
from kvshelf.errors import StoreFull
from test_store_crash import blob_files


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 4 MiB tmpfs, for tests marked ``host_feature("mount")``: skipped (with the reason) where this machine
    does not let the test mount one; the fault-injection test covers ENOSPC there."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    need("mount")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"mount -t tmpfs failed although the probe mounted one: {done.stderr.strip()}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _save(store, session: str, length: int):
    return store.save(session, sw.session_tokens(session, length), sw.build_caches(session, length))


def _check_intact(store, saved: dict[str, int]) -> None:
    assert store.verify(deep=True) == []
    assert sw.session_ids(store) == sorted(saved)
    for session, length in saved.items():
        r = store.restore(session)
        assert r.length == length
        assert list(r.tokens) == sw.session_tokens(session, length)
        assert sw.mismatch(r.caches, session, length) is None


def _fill_until_full(store, saved: dict[str, int], limit: int = 60) -> tuple[str, StoreFull]:
    """Save ever new 560-token sessions until one raises StoreFull; returns that session and the error."""
    for i in range(limit):
        session = f"f{i % sw.FAMILIES}-fill-{i}"
        try:
            _save(store, session, 560)
        except StoreFull as exc:
            return session, exc
        saved[session] = 560
    raise AssertionError(f"{limit} saves of 560 tokens never filled the disk")


def _assert_clear(exc: StoreFull) -> None:
    message = str(exc).lower()
    assert "space" in message or "full" in message, f"StoreFull message does not say what failed: {exc}"
    assert isinstance(exc, OSError)


def _recover(store, store_dir: Path, saved: dict[str, int], failed: str) -> None:
    """Free space by deleting two sessions and collecting; the failed save then goes through."""
    for session in sorted(saved)[:2]:
        store.delete(session)
        del saved[session]
    store.gc(dry_run=False)
    _check_intact(store, saved)
    info = _save(store, failed, 300)
    assert info.length == 300
    saved[failed] = 300
    _check_intact(store, saved)
    assert len(blob_files(store_dir)) == store.stats()["packs"]


@pytest.mark.host_feature("mount")
def test_real_full_filesystem_raises_store_full_and_keeps_earlier_snapshots(small_fs: Path) -> None:
    store_dir = small_fs / "store"
    saved: dict[str, int] = {}
    with sw.open_test_store(store_dir) as store:
        _save(store, "f0-grow", 200)
        saved["f0-grow"] = 200
        failed, exc = _fill_until_full(store, saved)
        _assert_clear(exc)
        assert len(saved) >= 3, f"only {len(saved)} sessions fit in 4 MiB"
        _check_intact(store, saved)
        # growing an existing session on the full disk fails too, and leaves its old snapshot serving
        with pytest.raises(StoreFull):
            _save(store, "f0-grow", 700)
        _check_intact(store, saved)
    with sw.open_test_store(store_dir) as store:  # the index a failed write left behind opens and verifies
        _check_intact(store, saved)
        _recover(store, store_dir, saved, failed)


def _fill_to_the_last_block(where: Path) -> list[Path]:
    """Take every free block of the filesystem with 4 KiB filler files; returns them (remove one to free a block)."""
    fillers = []
    while True:
        path = where / f"filler-{len(fillers)}"
        try:
            with open(path, "wb") as f:
                f.write(b"\xff" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            path.unlink(missing_ok=True)
            return fillers
        fillers.append(path)


@pytest.mark.host_feature("mount")
def test_real_full_filesystem_during_the_index_commit_raises_store_full(small_fs: Path) -> None:
    """A save that only reuses chunks writes no blob, just its manifest file and the LMDB commit. Freeing one block
    at a time, the first such save that fails meets ENOSPC in the commit (or its manifest): it must be StoreFull,
    and so must a delete that cannot commit on the full disk; the index stays as it was."""
    store_dir = small_fs / "store"
    saved: dict[str, int] = {}
    with sw.open_test_store(store_dir) as store:
        _failed, exc = _fill_until_full(store, saved)
        _assert_clear(exc)
        fillers = _fill_to_the_last_block(small_fs)
        # 128 tokens of a family's system prompt: two whole chunks every family has stored already
        for i in range(len(fillers)):
            fillers.pop().unlink()  # one free block
            session = f"f{i % sw.FAMILIES}-dedup-{i}"
            try:
                info = _save(store, session, 128)
            except StoreFull as full:
                _assert_clear(full)
                break
            assert info.bytes_written == 0, f"{session} wrote {info.bytes_written} new chunk bytes"
            saved[session] = 128
        else:
            raise AssertionError("no chunk-free save ever failed on the full disk")
        _check_intact(store, saved)
        _fill_to_the_last_block(small_fs)
        victim = sorted(saved)[0]
        try:
            store.delete(victim)
            del saved[victim]
        except StoreFull as full:
            _assert_clear(full)
        _check_intact(store, saved)
    for filler in small_fs.glob("filler-*"):
        filler.unlink()
    with sw.open_test_store(store_dir) as store:
        _check_intact(store, saved)
        session = "f0-after-full"
        assert _save(store, session, 128).bytes_written == 0
        saved[session] = 128
        _check_intact(store, saved)


def test_injected_enospc_in_the_blob_writer_raises_store_full(tmp_path: Path, request) -> None:
    from kvshelf.store.base import seams

    store_dir = tmp_path / "store"
    saved: dict[str, int] = {}
    budget = {"left": 2_500_000}  # bytes the "disk" still takes

    def full_disk(path: str, nbytes: int) -> None:
        if nbytes > budget["left"]:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        budget["left"] -= nbytes

    seams.FAULT_HOOK.append(full_disk)
    request.addfinalizer(seams.FAULT_HOOK.clear)
    with sw.open_test_store(store_dir) as store:
        _save(store, "f0-grow", 200)
        saved["f0-grow"] = 200
        failed, exc = _fill_until_full(store, saved)
        _assert_clear(exc)
        assert isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOSPC
        assert len(saved) >= 3
        _check_intact(store, saved)
        with pytest.raises(StoreFull):
            _save(store, "f0-grow", 700)
        _check_intact(store, saved)
        assert list((store_dir / "tmp").iterdir()) == [], "a failed write left its temporary file behind"
    with sw.open_test_store(store_dir) as store:
        _check_intact(store, saved)
        budget["left"] = 10**9
        _recover(store, store_dir, saved, failed)
