"""Quarantine keeps its evidence and stays visible (issue 12): after a corrupt chunk quarantines a snapshot, nothing
is unlinked — not by the quarantine, not by a delete of a session sharing the pack, not by gc — and ``verify`` /
``kvshelf verify`` report it naming the session, until an operator drops it (exit 0 since issue 30: a quarantined
snapshot is already out of service, so it is listed as handled, not an alarm); only then does gc reclaim.
``rebuild_index`` over a damaged pack trailer reports what it skipped and why instead of dropping it silently.
"""

from __future__ import annotations

from store_cases import chunk_file, flip_chunk_byte
from tools_data import MODEL, make_caches, run_json

from kvshelf import open_store
from kvshelf.errors import CorruptData

N = 48


def test_quarantined_snapshot_keeps_its_bytes_and_stays_a_finding_until_dropped(tmp_path) -> None:
    root = tmp_path / "s"
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        a = store.save("a", list(range(N)), make_caches("mla", N, 1))
        store.save("b", list(range(1000, 1000 + N)), make_caches("mla", N, 2))
        bad = store.admin.manifest(a.snapshot_id).chunks[-1].hash
        pack = store.admin.chunk_location(bad)[0]
        flip_chunk_byte(store, bad)
        try:
            store.restore("a")
            raise AssertionError("a corrupt chunk restored")
        except CorruptData:
            pass
        assert (root / pack).exists()  # quarantine unlinked nothing
        assert store.gc(dry_run=False).orphan_objects == [] and (root / pack).exists()  # nor does gc
        store.delete("b")
        store.gc(dry_run=False)
        assert (root / pack).exists()
        found = [(f.kind, f.sessions) for f in store.verify(deep=True)]
        assert found == [("quarantined", ("a",))]
    doc = run_json("verify", "--deep", "--store", str(root))
    assert [(p["kind"], p["session_id"]) for p in doc["problems"]] == [("quarantined", "a")]
    assert doc["handled"] == 1 and doc["needs_operator"] == 0
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        assert store.drop_quarantined(a.snapshot_id) and not store.drop_quarantined(a.snapshot_id)
        report = store.gc(dry_run=False)
        assert pack in report.orphan_objects and not (root / pack).exists()
        assert store.verify(deep=True) == []
    run_json("verify", "--deep", "--store", str(root))


def test_rebuild_reports_a_damaged_trailer_instead_of_dropping_it_silently(tmp_path) -> None:
    root = tmp_path / "s"
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        a = store.save("a", list(range(N)), make_caches("mla", N, 1))
        store.save("b", list(range(1000, 1000 + N)), make_caches("mla", N, 2))
        pack = root / chunk_file(store, store.admin.manifest(a.snapshot_id).chunks[0].hash)[0]
    data = bytearray(pack.read_bytes())
    data[-40] ^= 0x10  # inside the trailer's body (the manifest): its checksum no longer matches
    pack.write_bytes(bytes(data))
    with open_store(root, admin=True) as store:
        assert store.rebuild_index() == 1
        skipped = store.admin.rebuild_report()
        assert [f.kind for f in skipped] == ["rebuild-skipped-pack"]
        assert pack.name in skipped[0].where and "checksum" in skipped[0].detail
        assert {m.session_id for m in store.admin.iter_manifests()} == {"b"}
