"""The LMDB index never leaks a raw error or kills the process (issue 12: "one error root, enforced").

- another process grows the map: every other open handle adopts the new size (``MapResizedError`` handled);
- a truncated or overwritten ``data.mdb`` is ``CorruptData`` at open, checked against LMDB's own meta pages before
  the file is mapped (a short file would be a SIGBUS: these cases run in a child process so a regression shows as
  a signal, not a dead test run);
- damaged pages inside the file surface as ``KvShelfError`` subclasses from every call, and ``close()`` never raises;
- a save gate held by someone else is ``StoreBusy`` (never ``TimeoutError``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tools_data import MODEL, make_caches, same_reads

from kvshelf import open_store
from kvshelf.errors import CorruptData, StoreBusy

ROOT = Path(__file__).resolve().parents[2]
N = 64


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'helpers'}")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                          text=True, timeout=300)


GROW = """
    import sys
    from tools_data import MODEL, make_caches
    from kvshelf import open_store
    caches = make_caches("mla", 64, 1, layers=1)
    with open_store(sys.argv[1], identity=MODEL, chunk_tokens=8, map_size=1 << 20) as s:
        n = 0
        while s.index.env.info()["map_size"] < 4 << 20:   # grown (doubled) at least twice by this process
            s.save(f"grow-{n}", [(n + 1) * 100_000 + i for i in range(64)], caches)
            n += 1
        print(n, s.index.env.info()["map_size"])
"""


def test_a_map_grown_by_another_process_is_adopted(tmp_path: Path) -> None:
    root = tmp_path / "store"
    caches = make_caches("mla", N, 7, layers=1)
    tokens = list(range(N))
    with open_store(root, identity=MODEL, chunk_tokens=8, map_size=1 << 20) as s:
        s.save("mine", tokens, caches)
        grown = _child(GROW, str(root))
        assert grown.returncode == 0, grown.stderr
        saves, size = map(int, grown.stdout.split())
        assert size >= 4 << 20 and saves > 1
        # every kind of call of the handle opened before the growth: reads, writes, listings
        assert s.lookup(tokens).session_id == "mine"
        assert same_reads(s.restore("mine").caches, caches)
        assert len(s.sessions()) == saves + 1
        s.save("after", tokens[:32], make_caches("mla", 32, 8, layers=1))
        assert s.restore("after").tokens == tokens[:32]
        assert s.verify(deep=True) == []


OPEN_DAMAGED = """
    import sys
    from kvshelf import open_store
    from kvshelf.errors import KvShelfError
    from tools_data import MODEL
    try:
        with open_store(sys.argv[1], identity=MODEL) as s:
            s.sessions()
        print("opened")
    except KvShelfError as exc:
        print(type(exc).__name__, exc)
"""


def _saved_store(root: Path) -> Path:
    with open_store(root, identity=MODEL, chunk_tokens=8) as s:
        for i in range(6):
            s.save(f"s{i}", [i * 1000 + t for t in range(N)], make_caches("mla", N, i, layers=1))
    return root / "index" / "data.mdb"


@pytest.mark.parametrize("damage", ["half", "one-page-short", "zeroed-metas", "garbage", "tiny"])
def test_a_damaged_data_mdb_is_corrupt_data_at_open(tmp_path: Path, damage: str) -> None:
    data = _saved_store(tmp_path / "store")
    size = data.stat().st_size
    with open(data, "r+b") as f:
        if damage == "half":
            f.truncate(size // 2)
        elif damage == "one-page-short":
            f.truncate(size - 4096)
        elif damage == "zeroed-metas":
            f.write(b"\0" * 8192)
        elif damage == "garbage":
            f.write(os.urandom(8192))
        else:
            f.truncate(100)
    out = _child(OPEN_DAMAGED, str(tmp_path / "store"))
    assert out.returncode == 0, f"the child died ({out.returncode}): {out.stderr[-2000:]}"
    assert out.stdout.startswith("CorruptData"), out.stdout + out.stderr[-2000:]


def test_a_truncated_index_is_refused_in_process_too(tmp_path: Path) -> None:
    data = _saved_store(tmp_path / "store")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(CorruptData, match="truncated"):
        open_store(tmp_path / "store", identity=MODEL)
    # and the store directory is not left held: fixing the file (here: removing it) makes it openable
    data.unlink()
    with open_store(tmp_path / "store", identity=MODEL) as s:
        assert s.sessions() == []


WALK_DAMAGED = """
    import sys, traceback
    from kvshelf import open_store
    from kvshelf.errors import KvShelfError
    from tools_data import MODEL
    raw = []
    def call(what, fn):
        try:
            fn()
        except KvShelfError:
            pass
        except BaseException as exc:
            raw.append(f"{what}: {type(exc).__module__}.{type(exc).__name__}: {exc}")
    try:
        s = open_store(sys.argv[1], identity=MODEL, chunk_tokens=8)
    except KvShelfError:
        print("ok")
        raise SystemExit(0)
    call("sessions", s.sessions)
    for i in range(6):
        call("lookup", lambda: s.lookup([i * 1000 + t for t in range(64)]))
        call("restore", lambda: s.restore(f"s{i}"))
    call("verify", lambda: s.verify(deep=True))
    call("stats", s.stats)
    call("save", lambda: s.save("new", list(range(8)), []))
    call("close", s.close)
    print("\\n".join(raw) if raw else "ok")
"""


def test_damaged_index_pages_never_leak_a_raw_lmdb_error(tmp_path: Path) -> None:
    """One byte flipped in each of several pages past the two meta pages: every call fails as a ``KvShelfError``
    or works, close() included (the child reports any other exception; a signal fails the test too)."""
    clean = _saved_store(tmp_path / "clean")
    body = clean.read_bytes()
    pages = len(body) // 4096
    assert pages > 4
    chosen = sorted({2, 3, pages // 2, pages - 1})
    for n, page in enumerate(chosen):
        for where in (2, 4000):  # page header flags/bounds, first node pointers, the node data at the end
            root = tmp_path / f"d{n}-{where}"
            (root / "index").mkdir(parents=True)
            os.system(f"cp -a {tmp_path / 'clean'}/. {root}/")
            damaged = bytearray(body)
            damaged[page * 4096 + where] ^= 0xFF
            (root / "index" / "data.mdb").write_bytes(bytes(damaged))
            out = _child(WALK_DAMAGED, str(root))
            assert out.returncode == 0, f"page {page}+{where}: the child died ({out.returncode}) {out.stderr[-1500:]}"
            assert out.stdout.strip() == "ok", f"page {page}+{where}: {out.stdout}"


def test_a_held_save_gate_is_store_busy(tmp_path: Path) -> None:
    with open_store(tmp_path / "store", identity=MODEL) as s, s.save_gate(exclusive=True):
        with pytest.raises(StoreBusy), s.save_gate(timeout=0.01):
            pass


def test_rebuild_index_repairs_a_truncated_index(tmp_path: Path) -> None:
    """The repair the CorruptData message names works: ``kvshelf rebuild-index`` sets the damaged index aside (kept
    as evidence) and rebuilds from the packs; every session restores again."""
    from tools_data import run_json

    data = _saved_store(tmp_path / "store")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    doc = run_json("rebuild-index", "--store", str(tmp_path / "store"))
    assert doc["snapshots"] == 6 and doc["damaged_index_kept_at"] and Path(doc["damaged_index_kept_at"]).is_dir()
    with open_store(tmp_path / "store", identity=MODEL, chunk_tokens=8) as s:
        assert same_reads(s.restore("s3").caches, make_caches("mla", N, 3, layers=1))
        assert s.verify(deep=True) == []


@pytest.mark.parametrize("table", ["manifests", "summaries", "tokens", "chunks", "packs"])
def test_verify_reports_a_record_failing_its_checksum_and_never_raises(tmp_path: Path, table: str) -> None:
    """One byte of one sealed record flipped in place (its checksum now fails): verify returns findings (naming the
    session where the index still can), ``kvshelf verify --deep`` exits 1 with a report, and restoring the session
    is ``CorruptData`` or exact — never another token or a raw error."""
    from tools_data import run_json

    root = tmp_path / "store"
    caches = make_caches("mla", N, 3, layers=1)
    with open_store(root, identity=MODEL, chunk_tokens=8) as s:
        info = s.save("a", list(range(N)), caches)
        s.save("b", list(range(500, 500 + N)), make_caches("mla", N, 4, layers=1))
        with s.index.read() as txn:
            key = bytes.fromhex(info.snapshot_id) if table in ("manifests", "summaries", "tokens") else \
                next(bytes(k) for k, _v in txn.range(table))
            raw = bytearray(txn.get(table, key))
        raw[len(raw) // 2] ^= 0x04
        s.index.write(lambda txn: txn.put(table, key, bytes(raw)))
        found = s.verify(deep=True)
        assert found, "a damaged record must be a finding"
        if table in ("manifests", "summaries", "tokens"):
            assert any("a" in f.sessions for f in found), found
        try:
            r = s.restore("a")
            assert r.tokens == list(range(N)) and same_reads(r.caches, caches)
        except CorruptData:
            pass
        try:
            hit = s.lookup(list(range(N)))
            assert hit is None or hit.session_id == "a"
        except CorruptData:
            pass
    doc = run_json("verify", "--deep", "--store", str(root), expect_rc=1)
    assert doc["problems"]
