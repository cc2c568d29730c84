"""Layout v1 manifest files carry no checksum; a v2 store seals them when it opens the store (after checking each
agrees with the index's record), and ``rebuild_index`` indexes only sealed ones whose checksum holds, reporting
every other one — so a flipped token in a manifest file never becomes an indexed token (issue 12)."""

from __future__ import annotations

import os
import shutil

import msgspec
import pytest

from v1_fixture import EXPECTED, FIXTURE, IDENTITY, state_checksum
from kvshelf import open_store  # noqa: E402
from kvshelf.errors import SnapshotNotFound  # noqa: E402
from kvshelf.store.index import schema as mf  # noqa: E402
from kvshelf.store.index.schema import Manifest  # noqa: E402
from kvshelf.store.integrity.legacy_v1 import SEALED_KEY  # noqa: E402
VICTIM = "share-b"


@pytest.fixture
def v1_store(tmp_path):
    root = tmp_path / "v1"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("lock.mdb"))
    return root


def manifest_files(root) -> dict[str, str]:
    """session id -> path of its v1 manifest file."""
    out = {}
    for name in os.listdir(root / "blobs" / "manifests"):
        path = str(root / "blobs" / "manifests" / name)
        with open(path, "rb") as fh:
            out[mf.decode(fh.read(), Manifest, name).session_id] = path
    return out


def altered(path: str) -> bytes:
    """The file's manifest with one token changed, as bare (unsealed) msgpack: a flip that still decodes."""
    with open(path, "rb") as fh:
        m = mf.decode(fh.read(), Manifest, path)
    tokens = list(m.tokens)
    tokens[3] += 1
    return msgspec.msgpack.encode(msgspec.structs.replace(m, tokens=tokens))


def open_own(root):
    return open_store(root, identity=IDENTITY, chunk_tokens=EXPECTED["chunk_tokens"])


def check_sessions(store, names) -> None:
    for name in names:
        got = store.restore(name)
        assert got.tokens == EXPECTED["sessions"][name]["tokens"], name
        assert [state_checksum(c) for c in got.caches] == EXPECTED["sessions"][name]["checksums"], name


def test_opening_a_v1_store_seals_every_manifest_file_once(v1_store):
    files = manifest_files(v1_store)
    originals = {}
    for path in files.values():
        with open(path, "rb") as fh:
            originals[path] = fh.read()
    assert not any(mf.is_sealed(raw) for raw in originals.values())  # the fixture as v1 wrote it
    with open_own(v1_store) as store:
        with store.index.read() as txn:
            assert txn.get("meta", SEALED_KEY) is not None
        check_sessions(store, EXPECTED["sessions"])
        assert store.verify(deep=True) == []
    inodes = {}
    for path, raw in originals.items():
        with open(path, "rb") as fh:
            now = fh.read()
        assert mf.is_sealed(now) and mf.decode(now, Manifest, path) == mf.decode(raw, Manifest, path)
        inodes[path] = os.stat(path).st_ino
    with open_own(v1_store):  # sealed once per index: a second open rewrites nothing
        pass
    assert {p: os.stat(p).st_ino for p in inodes} == inodes


def test_a_flipped_byte_in_a_sealed_v1_manifest_is_skipped_and_reported_by_rebuild(v1_store):
    with open_own(v1_store):
        pass
    path = manifest_files(v1_store)[VICTIM]
    with open(path, "r+b") as fh:
        raw = bytearray(fh.read())
        raw[len(raw) // 2] ^= 0x01
        fh.seek(0)
        fh.write(raw)
    with open_store(v1_store, admin=True) as store:
        assert store.rebuild_index() == len(EXPECTED["sessions"]) - 1
        report = store.admin.rebuild_report()
        assert [(f.kind, os.path.basename(path) in f.where) for f in report] == [("rebuild-skipped-manifest", True)]
        assert "checksum" in report[0].detail
    with open_own(v1_store) as store:
        check_sessions(store, [n for n in EXPECTED["sessions"] if n != VICTIM])
        assert VICTIM not in {s.session_id for s in store.sessions()}


def test_an_unsealed_v1_manifest_is_never_indexed_and_is_reported(v1_store):
    """An unsealed file whose token was altered: the old rebuild indexed the altered tokens as the session's."""
    with open_own(v1_store):
        pass
    path = manifest_files(v1_store)[VICTIM]
    bad = altered(path)
    with open(path, "wb") as fh:
        fh.write(bad)
    with open_store(v1_store, admin=True) as store:
        assert store.rebuild_index() == len(EXPECTED["sessions"]) - 1
        report = store.admin.rebuild_report()
        assert len(report) == 1 and report[0].kind == "rebuild-skipped-manifest"
        assert "unsealed" in report[0].detail and report[0].sessions == (VICTIM,)
    with open_own(v1_store) as store:
        assert VICTIM not in {s.session_id for s in store.sessions()}
        hit = store.lookup(EXPECTED["sessions"][VICTIM]["tokens"] + [7])
        assert hit is None or hit.session_id != VICTIM
        check_sessions(store, [n for n in EXPECTED["sessions"] if n != VICTIM])
        # what only the left-out snapshot used is residue now (for gc), nothing else is wrong
        assert {f.kind for f in store.verify(deep=True)} == {"orphan-object", "orphan-manifest"}


def test_a_v1_manifest_disagreeing_with_the_index_stays_unsealed_and_verify_says_so(v1_store):
    path = manifest_files(v1_store)[VICTIM]
    bad = altered(path)
    with open(path, "wb") as fh:  # altered before any v2 open: the two copies disagree, neither is sealed
        fh.write(bad)
    with open_own(v1_store) as store:
        with open(path, "rb") as fh:
            assert not mf.is_sealed(fh.read())
        check_sessions(store, EXPECTED["sessions"])  # restores read the index's own copy
        kinds = [(f.kind, f.sessions) for f in store.verify()]
        assert kinds == [("unsealed-manifest-file", (VICTIM,))]
        assert sorted(f.kind for f in store.verify(deep=True)) == ["manifest-file-drift", "unsealed-manifest-file"]
    with open_store(v1_store, admin=True) as store:
        assert store.rebuild_index() == len(EXPECTED["sessions"]) - 1
        assert [f.sessions for f in store.admin.rebuild_report()] == [(VICTIM,)]
    with open_own(v1_store) as store:
        with pytest.raises(SnapshotNotFound):
            store.restore(VICTIM)
