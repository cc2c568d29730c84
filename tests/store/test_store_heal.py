"""A damaged chunk is never reused: the restore that finds it marks the copy bad in the transaction that quarantines
the snapshot, the next save of the same content writes fresh bytes and takes the chunk's name back (healing every
other session that used the copy), and a copy nobody re-saves is reported by ``verify`` with the sessions it
affects until ``repair`` drops them."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings, strategies as st

from store_cases import flip_chunk_byte
from tools_data import MODEL, make_caches, run_cli, run_json

from kvshelf import open_store
from kvshelf.errors import CorruptData, SnapshotNotFound
from bit_exact import snapshot_state

N = 48


def _bits(caches) -> list:
    return [[a.tobytes() for a in snapshot_state(c)] for c in caches]


def _three_sharing(root):
    """Sessions a, b, c holding the same content (every chunk shared), one chunk of it flipped."""
    store = open_store(root, identity=MODEL, chunk_tokens=16)
    infos = [store.save(s, list(range(N)), make_caches("mla", N, 1)) for s in "abc"]
    bad = store.admin.manifest(infos[0].snapshot_id).chunks[1].hash
    flip_chunk_byte(store, bad)
    return store, bad


def test_a_resave_heals_every_session_that_used_the_damaged_copy(tmp_path) -> None:
    store, bad = _three_sharing(tmp_path / "s")
    want = _bits(make_caches("mla", N, 1))
    with store:
        try:
            store.restore("a")
            raise AssertionError("a damaged chunk restored")
        except CorruptData:
            pass
        kinds = {(f.kind, f.where): f.sessions for f in store.verify()}
        assert kinds[("bad-chunk", f"chunk {bad}")] == ("b", "c")  # reported with the sessions it affects
        assert store.lookup(list(range(N)) + [7]) is None  # b and c would fail their restore: a miss, not a hit
        info = store.save("a", list(range(N)), make_caches("mla", N, 1))
        assert info.chunks_written == 1 and info.bytes_written > 0  # a fresh copy of the bad chunk, nothing more
        for s in "abc":
            assert _bits(store.restore(s).caches) == want
        assert store.lookup(list(range(N)) + [7]).length == N  # healed: a hit again
        assert store.verify(deep=True) == []  # the re-save cleared a's quarantine; the damaged copy was reclaimed


def test_a_save_never_dedupes_onto_a_bad_copy_across_handles(tmp_path) -> None:
    root = tmp_path / "s"
    store, bad = _three_sharing(root)
    with store:
        try:
            store.restore("b")
        except CorruptData:
            pass
    with open_store(root, identity=MODEL, chunk_tokens=16) as again:  # a restart: the mark is in the index
        info = again.save("d", list(range(N)), make_caches("mla", N, 1))
        assert info.chunks_written == 1
        assert _bits(again.restore("a").caches) == _bits(make_caches("mla", N, 1))
        assert [f.kind for f in again.verify(deep=True)] == ["quarantined"]


def _files(root) -> dict[str, bytes]:
    """Every file of the store but the handles' own (leases, locks, LMDB's lock file, the page walk's memo)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.parent.name not in ("leases", "locks") and p.name not in ("lock.mdb",
                                                                                        "data.mdb.walked")}


def test_repair_drops_what_no_good_copy_can_heal_and_reports_it(tmp_path) -> None:
    root = tmp_path / "s"
    store, bad = _three_sharing(root)
    with store:
        other = store.save("z", list(range(500, 500 + N)), make_caches("mla", N, 7))  # shares nothing: survives
        try:
            store.restore("a")
        except CorruptData:
            pass
        before = _files(root)
        dry = store.repair(dry_run=True)
        assert _files(root) == before  # a dry run changes nothing
        assert dry.dry_run and {r["session_id"] for r in dry.lost} == {"b", "c"} and dry.bad_chunks == [bad]
        report = store.repair(dry_run=False)
        assert {r["session_id"] for r in report.lost} == {"b", "c"}
        assert [q["session_id"] for q in report.dropped_quarantined] == ["a"]
        assert report.reclaimed_bytes > 0 and report.remaining == []
        assert store.verify(deep=True) == [] and store.admin.bad_chunks() == [] and store.admin.quarantined() == []
        assert [s.session_id for s in store.sessions()] == ["z"]
        assert _bits(store.restore("z").caches) == _bits(make_caches("mla", N, 7)) and other
        again = store.repair(dry_run=False)  # nothing left to do
        assert (again.lost, again.dropped_quarantined, again.reclaimed_bytes) == ([], [], 0)


def test_the_cli_lists_repairs_and_drops(tmp_path) -> None:
    root = tmp_path / "s"
    store, bad = _three_sharing(root)
    with store:
        try:
            store.restore("a")
        except CorruptData:
            pass
    doc = run_json("quarantine", "ls", "--store", str(root))
    assert [q["session_id"] for q in doc["quarantined"]] == ["a"] and [b["hash"] for b in doc["bad_chunks"]] == [bad]
    doc = run_json("verify", "--store", str(root), expect_rc=1)
    assert {(p["kind"], p["session_id"]) for p in doc["problems"]} >= {("quarantined", "a"), ("bad-chunk", "b")}
    before = _files(root)
    dry = run_json("repair", "--dry-run", "--store", str(root))
    assert _files(root) == before and {r["session_id"] for r in dry["lost"]} == {"b", "c"}
    assert run_cli("quarantine", "drop", "--store", str(root)).returncode == 2  # neither an ID nor --all
    sid = doc["problems"][0]["where"].split()[1] if doc["problems"][0]["kind"] == "quarantined" else None
    dropped = run_json("quarantine", "drop", "--all", "--store", str(root))
    assert len(dropped["dropped"]) == 1 and (sid is None or dropped["dropped"] == [sid])
    done = run_json("repair", "--store", str(root))
    assert {r["session_id"] for r in done["lost"]} == {"b", "c"} and done["remaining"] == []
    proc = run_cli("repair", "--store", str(root))
    assert proc.returncode == 0 and "dropped 0 lost session(s)" in " ".join(proc.stdout.split())  # piped: wrapped to 80
    run_json("verify", "--deep", "--store", str(root))


def test_a_damaged_trailer_on_a_pack_with_live_chunks_is_reported_and_rewritten(tmp_path) -> None:
    root = tmp_path / "s"
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        first = store.save("a", list(range(N)), make_caches("mla", N, 1))
        pack = store.admin.chunk_location(store.admin.manifest(first.snapshot_id).chunks[0].hash)[0]
        store.save("b", list(range(N)), make_caches("mla", N, 1))  # b's chunks all lie in a's pack
        store.save("a", list(range(2000, 2000 + N)), make_caches("mla", N, 3))  # a moves on: the pack's manifest is old
        want = {s: _bits(store.restore(s).caches) for s in "ab"}
    data = bytearray((root / pack).read_bytes())
    data[-40] ^= 0x10  # inside the trailer's body: its checksum no longer matches
    (root / pack).write_bytes(bytes(data))
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        found = [f for f in store.verify(deep=True)]
        assert [(f.kind, f.where, f.sessions) for f in found] == [("damaged-trailer", f"pack {pack}", ("b",))]
        assert "would lose sessions 'b'" in found[0].detail and "run `kvshelf repair`" in found[0].detail
        report = store.repair(dry_run=False)
        assert report.rewritten_trailers == [pack] and report.lost == [] and report.remaining == []
        assert store.verify(deep=True) == [] and not (root / pack).exists()
    with open_store(root, admin=True) as store:
        store.rebuild_index()
        assert store.admin.rebuild_report() == []
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        assert {s: _bits(store.restore(s).caches) for s in "ab"} == want  # the rebuild lost nothing


def test_repair_heals_a_damaged_chunk_from_its_copy_in_another_pack(tmp_path) -> None:
    """A re-encoding moved the chunk to a pack of its own; the old pack (still live for its other chunks) keeps the
    old copy. When the indexed copy is damaged, repair verifies the old one and repoints the chunk at a fresh copy
    of it: every session restores bit-exact and nothing is lost."""
    root = tmp_path / "s"
    store = open_store(root, identity=MODEL, chunk_tokens=16)
    with store:
        infos = [store.save(s, list(range(N)), make_caches("mla", N, 1)) for s in "abc"]
        h = store.admin.manifest(infos[0].snapshot_id).chunks[1].hash
        old_pack = store.admin.chunk_location(h)[0]
        assert store.admin.rewrite_chunk(h, "zstd") is not None
        assert store.admin.chunk_location(h)[0] != old_pack and (root / old_pack).exists()
        flip_chunk_byte(store, h)
        try:
            store.restore("a")
            raise AssertionError("a damaged chunk restored")
        except CorruptData:
            pass
        before = _files(root)
        dry = store.repair(dry_run=True)
        assert _files(root) == before  # found and verified, nothing written
        assert [(c["chunk"], c["source"]) for c in dry.healed] == [(h, f"pack {old_pack}")] and dry.lost == []
        report = store.repair(dry_run=False)
        assert [c["chunk"] for c in report.healed] == [h] and report.healed[0]["sessions"] == ["b", "c"]
        assert report.lost == [] and report.remaining == []
        assert [q["session_id"] for q in report.dropped_quarantined] == ["a"]  # a's restore had quarantined it
        assert store.admin.bad_chunks() == [] and store.verify(deep=True) == []
        for s in "bc":
            assert _bits(store.restore(s).caches) == _bits(make_caches("mla", N, 1))
        assert store.save("a", list(range(N)), make_caches("mla", N, 1)).chunks_written == 0  # the healed copy dedupes


def test_repair_without_a_good_copy_anywhere_reports_the_loss_not_a_heal(tmp_path) -> None:
    """The old copy in the other pack is damaged too: it fails its hash, so it is not used."""
    root = tmp_path / "s"
    with open_store(root, identity=MODEL, chunk_tokens=16) as store:
        info = store.save("a", list(range(N)), make_caches("mla", N, 1))
        h = store.admin.manifest(info.snapshot_id).chunks[1].hash
        old = store.admin.chunk_location(h)
        store.admin.rewrite_chunk(h, "zstd")
        flip_chunk_byte(store, h)
        with open(root / old[0], "r+b") as f:  # the same flip in the old copy
            f.seek(old[1] + old[2] - 5)
            b = f.read(1)
            f.seek(old[1] + old[2] - 5)
            f.write(bytes([b[0] ^ 0x40]))
        report = store.repair(dry_run=False)
        assert report.healed == [] and [r["session_id"] for r in report.lost] == ["a"]
        assert store.verify(deep=True) == []


def test_a_repair_dry_run_on_damage_nothing_has_read_yet_writes_no_mark(tmp_path) -> None:
    """The dry run's deep verify finds the damage first (no restore or verify marked it before) and still writes
    nothing: not even the bad mark a verify would write."""
    root = tmp_path / "s"
    store, bad = _three_sharing(root)
    with store:
        before = _files(root)
        dry = store.repair(dry_run=True)
        assert dry.bad_chunks == [bad] and {r["session_id"] for r in dry.lost} == {"a", "b", "c"}
        assert _files(root) == before and store.admin.bad_chunks() == []


def test_deep_verify_marks_what_fails_its_hash_so_the_next_save_heals_it(tmp_path) -> None:
    """No restore has read the damaged chunk yet: verify finds it, marks the copy bad, and the next save of the same
    content writes fresh bytes instead of deduping onto it (which heals the other sessions)."""
    root = tmp_path / "s"
    store, bad = _three_sharing(root)
    with store:
        found = {(f.kind, f.where): f for f in store.verify(deep=True)}
        f = found[("corrupt-chunk", f"chunk {bad}")]
        assert f.sessions == ("a", "b", "c") and "marked bad" in f.detail
        assert [m["hash"] for m in store.admin.bad_chunks()] == [bad]
        assert store.lookup(list(range(N)) + [7]) is None  # no snapshot needing it is offered
        info = store.save("d", list(range(N)), make_caches("mla", N, 1))
        assert info.chunks_written == 1  # the fresh copy, and only it
        for s in "abcd":
            assert _bits(store.restore(s).caches) == _bits(make_caches("mla", N, 1))
        assert store.verify(deep=True) == []


_SESSIONS = ("s0", "s1", "s2", "s3")
_OPS = st.lists(st.one_of(
    st.tuples(st.just("save"), st.sampled_from(_SESSIONS), st.integers(1, 3)),
    st.tuples(st.just("damage"), st.sampled_from(_SESSIONS), st.integers(0, 5)),
    st.tuples(st.just("restore"), st.sampled_from(_SESSIONS), st.just(0)),
    st.tuples(st.just("repair"), st.just(""), st.booleans()),
), min_size=1, max_size=12)


@settings(max_examples=12)
@given(ops=_OPS)
def test_random_damage_save_repair_never_restores_wrong_bytes_and_loses_nothing_unreported(ops) -> None:
    """Content seeds 1-3 over four sessions, so chunks are shared across sessions and re-saves; after any
    sequence, a final repair leaves verify clean and every session restores bit-exact or was reported lost."""
    with tempfile.TemporaryDirectory() as tmp, open_store(Path(tmp) / "s", identity=MODEL, chunk_tokens=16) as store:
        want: dict[str, int] = {}  # session -> content seed of its last save
        reported: set[str] = set()

        def repair(dry_run: bool) -> None:
            report = store.repair(dry_run=dry_run)
            if not dry_run:
                reported.update(r["session_id"] for r in report.lost)
                reported.update(q["session_id"] for q in report.dropped_quarantined)
                assert report.remaining == []

        for op, s, arg in ops:
            if op == "save":
                store.save(s, list(range(N)), make_caches("mla", N, arg))
                want[s] = arg
                reported.discard(s)
            elif op == "damage" and s in want and s not in reported:
                current = {i.session_id: i.snapshot_id for i in store.sessions()}
                if s not in current:  # quarantined meanwhile: nothing of it to damage
                    continue
                chunks = store.admin.manifest(current[s]).all_chunks
                flip_chunk_byte(store, chunks[arg % len(chunks)].hash, from_end=5 + arg)
            elif op == "restore" and s in want and s not in reported:
                try:
                    got = _bits(store.restore(s).caches)
                except (CorruptData, SnapshotNotFound):
                    continue
                assert got == _bits(make_caches("mla", N, want[s]))  # never wrong bytes
            elif op == "repair":
                repair(arg)
        repair(False)
        assert store.verify(deep=True) == []
        for s, seed in want.items():
            if s in reported:
                continue
            assert _bits(store.restore(s).caches) == _bits(make_caches("mla", N, seed)), s
