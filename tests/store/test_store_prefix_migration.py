"""Index format 3 (prefix records tagged by session lineage, ``heads``): an older index is migrated at open, in one
write transaction. ``tests/data/v2_index_store`` was written by the format-2 code (``tests/data/make_v2_index_store.py``
says how), ``tests/data/v1_store`` by layout v1 (format 1); both must come out with exactly the records a
from-scratch computation gives (``tests/helpers/prefix_oracle.py``), open again without writing, restore, look up,
verify clean, compact and rebuild."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys

import lmdb
import pytest

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # tests/data
sys.path.insert(0, DATA)

from make_v1_store import state_checksum  # noqa: E402
from prefix_oracle import actual, expected  # noqa: E402

from kvshelf import Identity, open_store  # noqa: E402
from kvshelf.store.prefix import records
from kvshelf.store.base import syncs  # noqa: E402
from kvshelf.store.index.lmdb_env import INDEX_FORMAT  # noqa: E402

V2 = os.path.join(DATA, "v2_index_store")
V1 = os.path.join(DATA, "v1_store")


def load(name: str) -> dict:
    with open(os.path.join(DATA, name)) as f:
        return json.load(f)


V2_EXPECTED = load("v2_index_store.expected.json")
V1_EXPECTED = load("v1_store.expected.json")


def raw_index(root) -> tuple[int, int, int]:
    """(format, prefix records, heads) read straight from the LMDB file, without kvshelf."""
    env = lmdb.open(os.path.join(root, "index"), max_dbs=16, lock=False)
    try:
        with env.begin() as txn:
            fmt = struct.unpack("<Q", txn.get(b"format", db=env.open_db(b"meta", txn=txn)))[0]
            n = txn.stat(env.open_db(b"prefix", txn=txn, dupsort=True))["entries"]
            names = {bytes(k) for k, _ in txn.cursor()}
            heads = txn.stat(env.open_db(b"heads", txn=txn))["entries"] if b"heads" in names else 0
    finally:
        env.close()
    return fmt, n, heads


def copy(src, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(src, root, ignore=shutil.ignore_patterns("lock.mdb"))
    return root


def oracle(store, want: dict) -> tuple:
    """The expected table for the fixture's sessions, under the snapshot ids the store lists for them."""
    ids = {(s.session_id, s.namespace): s.snapshot_id for s in store.sessions(namespace=None)}
    sessions = {(name, s.get("namespace", "")): (s["tokens"], ids[(name, s.get("namespace", ""))])
                for name, s in want["sessions"].items()}
    return expected(store.id_key, sessions)


def open_fixture(root, want: dict):
    return open_store(root, identity=Identity(*want["identity"]), chunk_tokens=want["chunk_tokens"])


@pytest.mark.parametrize("fixture,want", [(V2, V2_EXPECTED), (V1, V1_EXPECTED)], ids=["format2", "format1"])
def test_an_older_index_is_migrated_at_open_in_one_write_transaction(tmp_path, fixture, want):
    root = copy(fixture, tmp_path)
    fmt, n_before, heads_before = raw_index(root)
    assert fmt == want.get("format", 1) and fmt < INDEX_FORMAT and heads_before == 0
    with syncs.counting() as commits, records.counting() as work:
        store = open_fixture(root, want)
    try:
        # the whole migration: one write transaction (a v1 store's first open also seals its v1 manifest files and
        # records that in one more: sealing.py)
        assert commits.get("index_commit") == (1 if fmt >= 2 else 2)
        assert work["put"] == n_before  # every boundary of every current session, re-tagged, nothing else
        assert actual(store) == oracle(store, want)
        for name, s in want["sessions"].items():
            ns = s.get("namespace", "")
            r = store.restore(name, namespace=ns)
            assert r.tokens == s["tokens"] and [state_checksum(c) for c in r.caches] == s["checksums"], name
            hit = store.lookup(s["tokens"] + [7], namespace=ns)
            assert hit is not None and hit.length == len(s["tokens"]) and hit.namespace == ns, name
        assert store.verify(deep=True) == []
    finally:
        store.close()
    assert raw_index(root)[:1] == (INDEX_FORMAT,)
    with syncs.counting() as commits:
        store = open_fixture(root, want)
    try:
        assert commits.get("index_commit", 0) == 0  # migrated once: opening again writes nothing
        assert actual(store) == oracle(store, want)
    finally:
        store.close()


def test_a_migrated_format2_store_takes_saves_compacts_and_rebuilds(tmp_path):
    from kvshelf.tools.compaction import compact

    root = copy(V2, tmp_path)
    want = V2_EXPECTED
    chat = want["sessions"]["chat-grown"]
    with open_fixture(root, want) as store:
        old = store.restore("chat-grown")
        with records.counting() as work:  # a re-save of a migrated session: only what changed
            store.save("chat-grown", old.tokens, old.caches)
        assert (work["put"], work["delete"]) == (0, 0)
        hit = store.lookup(chat["tokens"][:50] + [1, 2])
        assert hit.length == 50 and hit.session_id in {"chat", "chat-grown"}
        tenant = want["sessions"]["tenant"]
        assert store.lookup(tenant["tokens"][:45] + [3], namespace="tenant-x").session_id == "tenant"
        assert store.lookup(want["sessions"]["replaced"]["tokens"][:30] + [3]).session_id == "replaced"
        assert store.verify(deep=True) == []
    with open_store(root, admin=True) as store:
        report = compact(store, cold_after=1e10, grace=0.0, merge=True, densify_pages=False)
        assert report is not None
        assert store.verify(deep=True) == []
        assert store.rebuild_index() == len(want["sessions"])
    with open_fixture(root, want) as store:
        assert actual(store) == oracle(store, want)
        for name, s in want["sessions"].items():
            r = store.restore(name, namespace=s["namespace"])
            assert [state_checksum(c) for c in r.caches] == s["checksums"], name
        assert store.verify(deep=True) == []


def test_verify_sees_a_prefix_record_or_head_out_of_place(tmp_path):
    """The table must be exactly what the heads imply: a stray record, a missing one and a moved head are each a
    ``prefix-drift`` finding, and ``rebuild_index`` repairs them."""
    root = copy(V2, tmp_path)
    with open_fixture(root, V2_EXPECTED) as store:
        recs, heads = actual(store)
        key, value = next(iter(recs))
        lineage, sid = next(iter(heads.items()))
        stray = (b"\x01" * 16, b"\x02" * 128 + lineage)

        def findings(change):
            store.index.write(change)
            return sorted((f.kind, f.where.split(" (")[0].split(" ")[0], f.detail) for f in store.verify())

        got = findings(lambda txn: txn.dup_add("prefix", *stray))
        assert got == [("prefix-drift", "prefix", f"{len(recs) + 1} records, manifests imply {len(recs)}")]
        got = findings(lambda txn: (txn.dup_remove("prefix", *stray), txn.dup_remove("prefix", key, value)))
        assert [(k, w) for k, w, _d in got] == [("prefix-drift", "prefix"), ("prefix-drift", "snapshot")]
        assert "1 of " in got[1][2] and "prefix records missing" in got[1][2]
        got = findings(lambda txn: (txn.dup_add("prefix", key, value),
                                    txn.put("heads", lineage, b"\x03" * 16)))
        assert [(k, w) for k, w, _d in got] == [("prefix-drift", "prefix"), ("prefix-drift", "snapshot")]
        assert "names no indexed snapshot" in got[0][2] and "head points elsewhere" in got[1][2]
        findings(lambda txn: txn.put("heads", lineage, sid))
        assert store.verify() == []
        findings(lambda txn: txn.dup_add("prefix", *stray))
    with open_store(root, admin=True) as store:
        store.rebuild_index()
        assert store.verify() == []
