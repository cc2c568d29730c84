"""A damaged ``data.mdb`` never kills the process that opens the store (issue 12): ``CorruptData`` at open instead.

Each damaged open runs in a child process (``lmdb_flips``): without the page walk these flips kill it with a signal
inside liblmdb — a node offset pointing past the file end (SIGBUS), a branch page of one key (an assertion:
SIGABRT), a plain value flagged as a dupsort sub-page (SIGBUS or SIGABRT, as the bytes it then misreads fall), an
overflow value longer than the file (SIGBUS). The bytes are found by reading the real
store's pages here with ``struct`` (not with ``kvshelf.store.index.lmdb_pages``, the code under test).
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: ``tests`` as a package

from tests.helpers.lmdb_flips import make_pristine, run_flips  # noqa: E402

PSIZE = 4096


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_pristine(tmp_path_factory.mktemp("lmdb-flips"))


@pytest.fixture(scope="module")
def compacted(pristine) -> Path:
    """The pristine store with its index compacted (LMDB's own copy): every page live, so the file's last pages are
    leaves every verify reads — where a node offset past the page is also past the file's end."""
    import lmdb

    target = pristine.parent / "compacted"
    shutil.copytree(pristine, target, ignore=shutil.ignore_patterns("*.mdb", "*.walked"))
    env = lmdb.open(str(pristine / "index"), readonly=True, lock=False, max_dbs=16)
    env.copy(str(target / "index"), compact=True)
    env.close()
    shutil.copy(pristine.parent / f"{pristine.name}.json", pristine.parent / f"{target.name}.json")
    return target


def _pages(pristine: Path) -> bytes:
    return (pristine / "index" / "data.mdb").read_bytes()


def _page(data: bytes, pgno: int) -> tuple[int, int, int, list[int]]:
    """(flags, lower, upper, node offsets) of page ``pgno``."""
    _n, _pad, flags, lower, upper = struct.unpack_from("<QHHHH", data, pgno * PSIZE)
    return flags, lower, upper, list(struct.unpack_from(f"<{(lower - 16) // 2}H", data, pgno * PSIZE + 16))


def _main_root(data: bytes) -> int:
    metas = [data[:152], data[PSIZE:PSIZE + 152]]
    meta = max(metas, key=lambda m: struct.unpack_from("<Q", m, 144)[0])
    return struct.unpack_from("<Q", meta, 88 + 40)[0]


def _named_roots(data: bytes) -> dict[bytes, int]:
    """The root page of each named sub-database (the main tree is one leaf in this small store)."""
    root, roots = _main_root(data), {}
    flags, _lo, _up, ptrs = _page(data, root)
    assert flags == 0x02, "the main tree is expected to be a single leaf"
    for p in ptrs:
        at = root * PSIZE + p
        _lo, _hi, _flags, ksize = struct.unpack_from("<HHHH", data, at)
        roots[data[at + 8:at + 8 + ksize]] = struct.unpack_from("<Q", data, at + 8 + ksize + 40)[0]
    return roots


def _leaves(data: bytes, root: int) -> list[int]:
    """Every leaf page of the tree at ``root``, left to right (empty tree: none)."""
    if root == (1 << 64) - 1:
        return []
    flags, _lo, _up, ptrs = _page(data, root)
    if flags != 0x01:
        return [root]
    out = []
    for p in ptrs:
        lo, hi, nflags, _k = struct.unpack_from("<HHHH", data, root * PSIZE + p)
        out += _leaves(data, lo | hi << 16 | nflags << 32)
    return out


def _node_flags(data: bytes, pgno: int, p: int) -> int:
    return struct.unpack_from("<H", data, pgno * PSIZE + p + 4)[0]


def test_a_node_offset_past_the_file_end_is_corrupt_data_not_sigbus(compacted) -> None:
    data = _pages(compacted)
    last = max(pg for root in [_main_root(data), *_named_roots(data).values()] for pg in _leaves(data, root))
    assert len(data) // PSIZE - last < 15, "a live leaf (verify reads them all) within 60 KiB of the file's end"
    first = _page(data, last)[3][0]
    mask = (first >> 8) ^ 0xF0  # the node offset becomes 0xF0xx: past the page and past the end of the file
    [outcome] = run_flips(compacted, [(last * PSIZE + 17, mask)], compacted.parent)
    assert outcome.startswith("detected: CorruptData") and "node offset" in outcome, outcome


def test_a_branch_page_of_one_key_is_corrupt_data_not_sigabrt(pristine) -> None:
    data = _pages(pristine)
    root = _named_roots(data)[b"tokens"]
    flags, lower, _upper, _ptrs = _page(data, root)
    assert flags == 0x01 and 20 <= lower < 256, "the tokens tree is a branch page over a few leaves"
    [outcome] = run_flips(pristine, [(root * PSIZE + 12, lower ^ 18)], pristine.parent)  # lower 18: one key
    assert outcome.startswith("detected: CorruptData") and "1 keys" in outcome, outcome


def test_a_plain_value_flagged_as_a_dupsort_subpage_is_corrupt_data_not_a_signal(pristine) -> None:
    data = _pages(pristine)
    plain = [(pg, p) for pg in _leaves(data, _named_roots(data)[b"prefix"]) for p in _page(data, pg)[3]
             if _node_flags(data, pg, p) == 0]  # a boundary only one snapshot holds: its value inline
    assert plain, "the prefix tree holds single-valued boundaries"
    pg, p = plain[0]
    [outcome] = run_flips(pristine, [(pg * PSIZE + p + 4, 0x04)], pristine.parent)  # F_DUPDATA set on it
    assert outcome.startswith("detected: CorruptData") and "sub-page" in outcome, outcome


def test_an_overflow_value_longer_than_the_file_is_corrupt_data_not_sigbus(pristine) -> None:
    data = _pages(pristine)
    big = [pg * PSIZE + p for pg in _leaves(data, _named_roots(data)[b"tokens"]) for p in _page(data, pg)[3]
           if _node_flags(data, pg, p) == 0x01]  # F_BIGDATA: a long token record on overflow pages
    assert big, "the store holds long token records"
    [outcome] = run_flips(pristine, [(big[0] + 2, 0x10)], pristine.parent)  # mn_hi: the value grows by 1 MiB
    assert outcome.startswith("detected: CorruptData") and "overflow" in outcome, outcome


def _sweep(data: bytes, rng: random.Random, per_page: int) -> list[tuple[int, int]]:
    """``per_page`` single-byte flips in every page (metas and free pages too): half of them among the bytes liblmdb
    steers by (header, node offsets, node headers), half anywhere in the page."""
    flips = []
    for pgno in range(len(data) // PSIZE):
        base = pgno * PSIZE
        _n, _pad, flags, lower, upper = struct.unpack_from("<QHHHH", data, base)
        steer = list(range(16 if pgno > 1 else 152))  # a meta page: its header and MDB_meta
        if pgno > 1 and flags in (0x01, 0x02) and 16 <= lower <= upper <= PSIZE:
            ptrs = _page(data, pgno)[3]
            steer += list(range(16, lower)) + [p + k for p in ptrs if p <= PSIZE - 8 for k in range(8)]
        for i in range(per_page):
            at = rng.choice(steer) if i % 2 == 0 else rng.randrange(PSIZE)
            flips.append((base + at, 1 << rng.randrange(8)))
    return flips


def _judge(flips: list, outcomes: list[str]) -> None:
    bad = [(f, o) for f, o in zip(flips, outcomes) if not o.startswith(("ok", "detected"))]
    assert not bad, bad[:10]
    detected = [o for o in outcomes if o.startswith("detected")]
    assert all(o.startswith(("detected: CorruptData", "detected: SnapshotNotFound", "detected: KvShelfError",
                             "detected: IncompatibleFormat")) for o in detected), sorted(set(detected))[:10]


def test_flips_in_every_page_never_kill_the_process(pristine) -> None:
    """A flip in every page of the whole file (~340, batched into a few child processes): every open raises a
    ``KvShelfError`` or works, and what works lists, restores and verifies — no signal, no foreign exception."""
    data = _pages(pristine)
    flips = _sweep(data, random.Random(12), per_page=1)
    outcomes = run_flips(pristine, flips, pristine.parent)
    _judge(flips, outcomes)
    assert sum(o.startswith("detected: CorruptData") for o in outcomes) > len(flips) // 10  # the walk is at work


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_many_flips_in_every_page_never_kill_the_process(pristine, seed) -> None:
    """Three more flips per page, twice (the soak's data.mdb rows flip thousands more at random)."""
    data = _pages(pristine)
    flips = _sweep(data, random.Random(1000 + seed), per_page=3)
    _judge(flips, run_flips(pristine, flips, pristine.parent))


def test_rebuild_index_repairs_a_page_damaged_index(pristine, tmp_path) -> None:
    """The way back the error names: ``kvshelf rebuild-index`` sets the damaged index aside and rebuilds it from the
    packs; every session is back."""
    from tests.helpers.tools_data import run_cli, run_json

    store = tmp_path / "store"
    shutil.copytree(pristine, store, ignore=shutil.ignore_patterns("*.walked"))
    data = bytearray(_pages(store))
    root = _named_roots(bytes(data))[b"tokens"]
    data[root * PSIZE + 12] ^= _page(bytes(data), root)[1] ^ 18  # a branch page of one key (liblmdb: SIGABRT)
    (store / "index" / "data.mdb").write_bytes(bytes(data))
    listing = run_cli("ls", "--store", str(store))
    assert listing.returncode != 0 and listing.returncode > 0, listing  # an error exit, not a signal
    assert "CorruptData" in listing.stderr + listing.stdout and "rebuild-index" in listing.stderr + listing.stdout
    doc = run_json("rebuild-index", "--store", str(store))
    assert doc["damaged_index_kept_at"] and Path(doc["damaged_index_kept_at"], "data.mdb").exists()
    sessions = json.loads((pristine.parent / f"{pristine.name}.json").read_text())["sessions"]
    assert doc["snapshots"] == len(sessions)
    assert len(run_json("ls", "--store", str(store))["sessions"]) == len(sessions)
    assert run_json("verify", "--deep", "--store", str(store))["problems"] == []


def test_an_empty_manifest_key_is_a_finding_not_a_raw_lmdb_error(pristine) -> None:
    """A leaf node of the manifests table whose key size is flipped to 0: a structurally valid page (the walk lets it
    through), but a 0-byte key that LMDB refuses as an argument (``BadValsizeError``) when verify looks the snapshot
    up in the other tables — found by the per-page sweep. verify reports it; nothing raw leaves."""
    data = _pages(pristine)
    leaf = _leaves(data, _named_roots(data)[b"manifests"])[0]
    node = _page(data, leaf)[3][0]
    ksize_at = leaf * PSIZE + node + 6
    assert struct.unpack_from("<H", data, ksize_at)[0] == 16  # a snapshot id
    [outcome] = run_flips(pristine, [(ksize_at, 16)], pristine.parent)  # 16 ^ 16 = 0
    assert outcome.startswith(("ok", "detected:")), outcome


def test_a_short_meta_record_is_corrupt_data_not_a_struct_error(tmp_path) -> None:
    """``total_bytes`` (an int64 the ledger reads on every save and delete) cut to 3 bytes."""
    import lmdb

    from kvshelf.errors import CorruptData
    from tests.helpers.store_workers import build_caches, open_test_store, session_tokens

    root = tmp_path / "s"
    with open_test_store(root) as store:
        store.save("f0-a", session_tokens("f0-a", 100), build_caches("f0-a", 100))
    env = lmdb.open(str(root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"total_bytes", b"abc", db=env.open_db(b"meta", txn=txn))
    env.close()
    with open_test_store(root) as store:
        with pytest.raises(CorruptData, match="total_bytes"):
            store.save("f0-b", session_tokens("f0-b", 100), build_caches("f0-b", 100))
        found = store.verify()
        assert found and all(f.kind for f in found)
