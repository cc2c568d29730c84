"""gc removes a tombstone once no manifest left on disk needs it, and never one a rebuild still needs."""

from __future__ import annotations

import mlx.core as mx

from kvshelf.latent_legos.kv import KVCache
from kvshelf.store import Identity, open_store

IDENT = Identity("tombs/model")


def _caches(tokens: int, seed: int, shared: int = 0) -> list:
    """Two layers; the first ``shared`` positions are the same for every seed (so chunks are shared across sessions)."""
    out = []
    for layer in range(2):
        c = KVCache()
        base = mx.random.normal((1, 2, shared, 8), key=mx.random.key(layer)) if shared else None
        own = mx.random.normal((1, 2, tokens - shared, 8), key=mx.random.key(1000 * seed + layer))
        k = own if base is None else mx.concatenate([base, own], axis=2)
        c.update_and_fetch(k, k + 1)
        out.append(c)
    return out


def _tombs(store) -> list[str]:
    return sorted(store.bytes.names("tomb/"))


def test_tombstone_stays_while_its_pack_survives_then_goes(tmp_path):
    with open_store(tmp_path / "s", identity=IDENT, chunk_tokens=16) as store:
        store.save("a", list(range(48)), _caches(48, 1, shared=32))
        store.save("b", list(range(48)), _caches(48, 2, shared=32))  # dedups a's first two chunks: a's pack lives on
        store.delete("a")
        assert len(_tombs(store)) == 1
        report = store.gc(dry_run=False)
        assert report.tombstones == [] and len(_tombs(store)) == 1  # a's pack (with its manifest) is still there
        store.rebuild_index()
        assert [s.session_id for s in store.sessions()] == ["b"]  # the tombstone kept "a" dead
        store.delete("b")
        report = store.gc(dry_run=False)
        assert sorted(report.tombstones) == sorted(_tombs(store) + report.tombstones)  # all reported ones are gone
        assert _tombs(store) == [] and len(report.tombstones) == 2
        store.rebuild_index()
        assert list(store.sessions()) == []


def test_older_snapshot_of_a_deleted_session_keeps_the_tombstone(tmp_path):
    """A session saved twice: its first snapshot (replaced, never tombstoned) survives in a pack another session
    still references. Deleting the session tombstones only the second; that tombstone must outlive the first pack,
    or a rebuild would bring back the first snapshot of a deleted session."""
    with open_store(tmp_path / "s", identity=IDENT, chunk_tokens=16) as store:
        store.save("a", list(range(48)), _caches(48, 1, shared=32))
        store.save("b", list(range(48)), _caches(48, 2, shared=32))
        store.save("a", list(range(64)), _caches(64, 3))  # a's first pack is dead but holds b's shared chunks
        store.delete("a")
        store.gc(dry_run=False)
        assert len(_tombs(store)) == 1
        store.rebuild_index()
        assert [s.session_id for s in store.sessions()] == ["b"]


def test_dry_run_reports_without_removing(tmp_path):
    with open_store(tmp_path / "s", identity=IDENT, chunk_tokens=16) as store:
        store.save("a", list(range(32)), _caches(32, 1))
        store.delete("a")
        report = store.gc(dry_run=True)
        assert len(report.tombstones) == 1 and _tombs(store) == report.tombstones
        assert store.gc(dry_run=False).tombstones == report.tombstones and _tombs(store) == []


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPS = st.lists(st.tuples(st.sampled_from(["save", "delete", "gc"]), st.sampled_from("abc"), st.integers(1, 3)),
                min_size=1, max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_gc_then_rebuild_never_resurrects_or_loses(tmp_path_factory, ops):
    """Any mix of saves (sharing chunks), deletes and gc runs: a rebuild afterwards gives back exactly the sessions
    the index held — every tombstone gc removed was one no surviving manifest needed."""
    path = tmp_path_factory.mktemp("tombs")
    with open_store(path / "s", identity=IDENT, chunk_tokens=16) as store:
        for i, (op, session, size) in enumerate(ops):
            if op == "save":
                n = 16 * (size + 1)
                store.save(session, list(range(i, i + n)), _caches(n, 10 * i + size, shared=16))
            elif op == "delete":
                if any(s.session_id == session for s in store.sessions()):
                    store.delete(session)
            else:
                store.gc(dry_run=False)
        store.gc(dry_run=False)
        before = sorted((s.session_id, s.snapshot_id) for s in store.sessions())
        store.rebuild_index()
        assert sorted((s.session_id, s.snapshot_id) for s in store.sessions()) == before
