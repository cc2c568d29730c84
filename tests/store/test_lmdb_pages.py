"""The page walk of ``data.mdb`` (``lmdbcheck`` + ``lmdbpages``), in process: no healthy file is refused, no
damaged file makes the walk itself fail in any other way than ``CorruptData``, and ``walkmemo`` spares the walk
only for a file nobody wrote since it passed. (Damaged files opened through liblmdb: ``test_lmdb_flips``.)
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvshelf.errors import CorruptData
from kvshelf.store.index import lmdb_check as lmdbcheck, lmdb_walk_memo as walkmemo

ROOT = Path(__file__).resolve().parents[2]
KINDS = [{}, {"dupsort": True}, {"dupsort": True, "dupfixed": True}, {"integerkey": True},
         {"dupsort": True, "dupfixed": True, "integerdup": True}, {"reverse_key": True}]


def _meta(path: Path) -> tuple[int, int]:
    """(pages in the file, mm_last_pg + 1 of the newer meta page)."""
    data = (path / "data.mdb").read_bytes()
    metas = [data[:152], data[4096:4096 + 152]]
    meta = max(metas, key=lambda m: int.from_bytes(m[144:152], "little"))
    return len(data) // 4096, int.from_bytes(meta[136:144], "little") + 1


def workload(path: Path, seed: int) -> None:
    """A random history of transactions over named databases of every kind LMDB has (plain, dupsort, dupfixed,
    integer keys and values, reversed keys): puts of 0..40,000-byte values (overflow pages), dupsort sets that outgrow
    a sub-page into a sub-database, deletes, cursor deletes of runs, emptied databases."""
    rng = random.Random(seed)
    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=8)
    dbs = [env.open_db(f"db{i}".encode(), **kind) for i, kind in enumerate(KINDS)]
    for _txn in range(rng.randrange(1, 12)):
        with env.begin(write=True) as txn:
            for _ in range(rng.randrange(1, 400)):
                i = rng.randrange(len(dbs))
                kind, db = KINDS[i], dbs[i]
                if kind.get("integerkey"):
                    key = rng.randrange(2000).to_bytes(8, "little")
                elif rng.random() < 0.5:
                    key = rng.randbytes(rng.choice([1, 4, 16, 100, 400]))
                else:
                    key = str(rng.randrange(50)).encode()
                if kind.get("dupfixed"):
                    value = rng.randrange(100000).to_bytes(8, "little")
                elif kind.get("dupsort"):
                    value = rng.randbytes(rng.choice([1, 8, 16, 60]))
                else:
                    value = rng.randbytes(rng.choice([0, 1, 10, 100, 1500, 3000, 9000, 40000]))
                r = rng.random()
                if r < 0.7:
                    txn.put(key, value, db=db)
                elif r < 0.95:
                    txn.delete(key, db=db)
                elif r < 0.97:
                    txn.drop(db, delete=False)
                else:
                    cursor = txn.cursor(db=db)
                    if cursor.first():
                        for _ in range(rng.randrange(50)):
                            if not cursor.delete():
                                break
    env.close()


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1))
@example(seed=20)  # ends 10 pages short of mm_last_pg + 1 (see the next test)
def test_every_healthy_lmdb_file_passes_the_walk(tmp_path_factory, seed) -> None:
    path = tmp_path_factory.mktemp("healthy")
    workload(path, seed)
    assert lmdbcheck.check_data_file(str(path)) == 1
    with lmdb.open(str(path), max_dbs=8, readonly=True) as env, env.begin() as txn:  # and LMDB agrees it is whole
        for name, _ in list(txn.cursor()):
            for _kv in txn.cursor(db=env.open_db(name, txn=txn, create=False)):
                pass


def test_large_value_sets_of_every_dupsort_kind_pass_the_walk(tmp_path) -> None:
    """Value sets big enough to leave their sub-page for nested trees of two levels: leaf2 pages (dupfixed, integer
    values), plain leaves of values; and each shrunk again below a sub-page by deletes."""
    env = lmdb.open(str(tmp_path), map_size=1 << 30, max_dbs=8)
    dbs = [env.open_db(b"fixed", dupsort=True, dupfixed=True), env.open_db(b"int", dupsort=True, dupfixed=True,
                                                                          integerdup=True),
           env.open_db(b"plain", dupsort=True)]
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(b"k", i.to_bytes(8, "little"), db=dbs[0])
            txn.put(b"k", i.to_bytes(8, "little"), db=dbs[1])
            txn.put(b"k%d" % (i % 3), b"v%06d" % i * 3, db=dbs[2])
    assert lmdbcheck.check_data_file(str(tmp_path)) == 1
    with env.begin(write=True) as txn:
        for i in range(2990):
            txn.delete(b"k", i.to_bytes(8, "little"), db=dbs[0])
            txn.delete(b"k%d" % (i % 3), b"v%06d" % i * 3, db=dbs[2])
    env.close()
    assert lmdbcheck.check_data_file(str(tmp_path)) == 1


def test_a_healthy_file_shorter_than_its_last_page_number_opens(tmp_path) -> None:
    """LMDB counts pages it allocated and freed within one transaction without writing them, so a file may end
    before page ``mm_last_pg``. The old open-time rule ("the file holds ``mm_last_pg + 1`` pages") refused it."""
    for seed in range(100):
        path = tmp_path / str(seed)
        path.mkdir()
        workload(path, seed)
        fpages, npages = _meta(path)
        if fpages < npages:
            break
        shutil.rmtree(path)
    else:
        raise AssertionError("no workload of 100 left a short file")
    assert lmdbcheck.check_data_file(str(path)) == 1
    with lmdb.open(str(path), max_dbs=8) as env, env.begin(write=True) as txn:
        txn.put(b"after", b"x" * 20000)  # and LMDB writes on, past its end


@pytest.fixture(scope="module")
def store_index(tmp_path_factory) -> Path:
    """A small real store's index (sessions of two cache kinds, two namespaces, a deleted session)."""
    sys.path.insert(0, str(ROOT))
    from tests.soak.cases import CHUNK, IDENTITY, make_caches, tokens_for

    from kvshelf import open_store

    root = tmp_path_factory.mktemp("store")
    with open_store(root, identity=IDENTITY, chunk_tokens=CHUNK) as store:
        for i in range(24):
            kind = "kv" if i % 2 else "rotating"
            n = 300 if i % 8 == 0 else 40
            store.save(f"s{i}", tokens_for(kind, i, n), make_caches(kind, n, i), namespace="t" if i % 5 == 2 else "")
        store.delete("s3")
    return root / "index"


def _copy(index: Path, into: Path) -> Path:
    into.mkdir(exist_ok=True)
    shutil.copy(index / "data.mdb", into / "data.mdb")
    return into


def _tick_past(index: Path) -> None:
    """Wait until the file-system clock has moved past ``data.mdb``'s last change (a probe file's stamp is later),
    as it has at any real open: only then may a passing walk be remembered."""
    probe = index / "probe"
    probe.touch()
    changed = (index / "data.mdb").stat().st_ctime_ns
    while (os.utime(probe), probe.stat().st_mtime_ns)[1] <= changed:
        pass
    probe.unlink()


@settings(max_examples=300)
@given(flips=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 7)), min_size=1, max_size=3),
       steer=st.booleans())
def test_any_damage_is_corrupt_data_or_passes_never_another_error(store_index, tmp_path_factory, flips, steer):
    """Single- to triple-bit flips anywhere (``steer``: within the first 16 bytes of a page or its first node
    offsets, where liblmdb steers): the walk passes or says ``CorruptData`` — never an IndexError, a struct error,
    a MemoryError or a hang from its own reading of garbage."""
    path = _copy(store_index, tmp_path_factory.mktemp("flip"))
    data = bytearray((path / "data.mdb").read_bytes())
    for at, bit in flips:
        at = (at % (len(data) // 4096)) * 4096 + at % 48 if steer else at % len(data)
        data[at] ^= 1 << bit
    (path / "data.mdb").write_bytes(bytes(data))
    try:
        lmdbcheck.check_data_file(str(path))
    except CorruptData as exc:
        assert "data.mdb" in str(exc) and "rebuild-index" in str(exc)


def test_the_message_names_the_file_the_page_and_the_way_back(store_index, tmp_path) -> None:
    path = _copy(store_index, tmp_path / "index")
    data = bytearray((path / "data.mdb").read_bytes())
    metas = [data[:152], data[4096:4096 + 152]]
    root = int.from_bytes(max(metas, key=lambda m: int.from_bytes(m[144:152], "little"))[128:136], "little")
    data[root * 4096] ^= 0x01  # the main tree's root carries another page number
    (path / "data.mdb").write_bytes(bytes(data))
    with pytest.raises(CorruptData) as err:
        lmdbcheck.check_data_file(str(path))
    text = str(err.value)
    assert str(path / "data.mdb") in text and f"page {root}" in text and "kvshelf rebuild-index" in text


# ---------------------------------------------------------------------------------------------------- walkmemo
def test_an_unchanged_file_is_walked_once(store_index, tmp_path) -> None:
    path = _copy(store_index, tmp_path / "index")
    _tick_past(path)
    assert lmdbcheck.check_data_file(str(path)) == 1
    assert (path / walkmemo.NAME).stat().st_mode & 0o777 == 0o600
    assert [lmdbcheck.check_data_file(str(path)) for _ in range(3)] == [0, 0, 0]


def test_a_flip_after_a_passing_walk_is_walked_and_caught(store_index, tmp_path) -> None:
    path = _copy(store_index, tmp_path / "index")
    _tick_past(path)
    assert lmdbcheck.check_data_file(str(path)) == 1
    with open(path / "data.mdb", "r+b") as f:  # same size, same meta pages: only mtime/ctime say it changed
        metas = [f.read(152), (f.seek(4096), f.read(152))[1]]
        root = int.from_bytes(max(metas, key=lambda m: int.from_bytes(m[144:152], "little"))[128:136], "little")
        f.seek(root * 4096 + 12)
        lower = f.read(1)[0]
        f.seek(root * 4096 + 12)
        f.write(bytes([lower ^ 0x80]))
    with pytest.raises(CorruptData):
        lmdbcheck.check_data_file(str(path))


def test_a_commit_after_a_passing_walk_is_walked_again(store_index, tmp_path) -> None:
    path = _copy(store_index, tmp_path / "index")
    _tick_past(path)
    assert lmdbcheck.check_data_file(str(path)) == 1
    with lmdb.open(str(path), max_dbs=16) as env, env.begin(write=True) as txn:
        txn.put(b"x", b"y", db=env.open_db(b"meta", txn=txn))
    assert lmdbcheck.check_data_file(str(path)) == 1


@pytest.mark.parametrize("content", [b"", b"KVSHWLK1" + b"\0" * 56, os.urandom(64), b"x" * 5000])
def test_a_damaged_or_foreign_memo_is_no_memo(store_index, tmp_path, content) -> None:
    path = _copy(store_index, tmp_path / "index")
    (path / walkmemo.NAME).write_bytes(content)
    _tick_past(path)
    assert lmdbcheck.check_data_file(str(path)) == 1
    assert lmdbcheck.check_data_file(str(path)) == 0  # rewritten whole


def test_no_memo_is_kept_when_the_file_changed_in_the_tick_the_walk_began(store_index, tmp_path) -> None:
    """A write in the same file-system clock tick as the stat would leave ``ctime`` unchanged: such a walk is not
    remembered (its stamp is not later than the file's ``ctime``); nor one whose key moved during the walk."""
    path = _copy(store_index, tmp_path / "index")
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        key = walkmemo.key_of(fd, (b"a", b"b"))
    finally:
        os.close(fd)
    memo = walkmemo.Pending(str(path))
    fields = list(walkmemo._KEY.unpack(key))
    fields[4] = memo.tick  # the file changed in the very tick the side file was stamped in
    moved = walkmemo._KEY.pack(*fields)
    memo.keep(moved, moved)
    memo.close()
    assert not walkmemo.remembered(str(path), moved)
    memo = walkmemo.Pending(str(path))
    memo.keep(key, key[:-1] + bytes([key[-1] ^ 1]))
    memo.close()
    assert not walkmemo.remembered(str(path), key)


# ---------------------------------------------------------------------------------------------------- concurrency
WRITER = """
import sys
sys.path[:0] = [{root!r}]
from tests.soak.cases import CHUNK, IDENTITY, make_caches, tokens_for
from kvshelf import open_store
with open_store({store!r}, identity=IDENTITY, chunk_tokens=CHUNK) as store:
    print("ready", flush=True)
    i = 0
    while sys.stdin.readline().strip() != "stop":
        for _ in range(4):
            store.save(f"w{{i % 40}}", tokens_for("kv", i, 40 + i % 300), make_caches("kv", 40 + i % 300, i))
            if i % 7 == 0 and f"w{{(i * 3) % 40}}" in {{s.session_id for s in store.sessions()}}:
                store.delete(f"w{{(i * 3) % 40}}")
            i += 1
        print("saved", flush=True)
"""


@pytest.mark.slow
def test_a_file_another_process_commits_to_is_never_called_damaged(tmp_path) -> None:
    """A writer process commits (saves, deletes: pages freed and reused) while this process checks the same file
    200 times, each check interleaved with a batch of commits: never ``CorruptData``."""
    store = tmp_path / "store"
    with subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT), store=str(store))], text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT) as proc:
        try:
            assert proc.stdout.readline().strip() == "ready"
            walks = []
            for _ in range(200):
                proc.stdin.write("go\n")
                proc.stdin.flush()  # the writer commits while this check walks
                walks.append(lmdbcheck.check_data_file(str(store / "index")))
                assert proc.stdout.readline().strip() == "saved"
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert all(0 <= w <= lmdbcheck.WALKS for w in walks) and sum(walks) >= 100, walks  # 0: met unchanged
