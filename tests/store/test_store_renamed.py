"""The names the store used before it said "chunk" for one thing, and before the tools' calls moved to
``store.admin``: each still answers for one release, with a DeprecationWarning naming the new name, and answers
exactly what the new name does (docs/API.md, "Renamed")."""

from __future__ import annotations

import pytest
from codec_cases import CASES_BY_ID
from store_cases import open_test_store, session, token_ids

MLA, LENGTHS = CASES_BY_ID["mla-f32-nodsa"], (24, 20, 20)


def test_old_field_names_warn_and_read_the_new_ones(tmp_path):
    with open_test_store(tmp_path / "s") as store:
        info = store.save("a", token_ids(64), session(MLA, LENGTHS))
        with pytest.warns(DeprecationWarning, match="chunks_written"):
            assert info.blobs_written == info.chunks_written > 0
        with pytest.warns(DeprecationWarning, match="chunks_reused"):
            assert info.blobs_reused == info.chunks_reused
        with pytest.warns(DeprecationWarning, match="chunks_written"):
            assert store.counters["blobs_written"] == store.counters["chunks_written"]
        with pytest.warns(DeprecationWarning, match="chunks_read"):
            assert store.counters.blobs_read == store.counters.chunks_read
        assert "blobs_written" not in dict(store.counters)  # the mapping lists the new names only
        report = store.gc(dry_run=True)
        with pytest.warns(DeprecationWarning, match="orphan_objects"):
            assert report.orphan_blobs == report.orphan_objects
        assert store.stats()["chunks"] == store.stats()["blobs"]


def test_old_tool_calls_on_store_warn_and_forward_to_admin(tmp_path):
    with open_test_store(tmp_path / "s") as store:
        info = store.save("a", token_ids(64), session(MLA, LENGTHS))
        with pytest.warns(DeprecationWarning, match="store.admin.manifest"):
            assert store.manifest(info.snapshot_id) == store.admin.manifest(info.snapshot_id)
        h = store.admin.manifest(info.snapshot_id).chunks[0].hash
        with pytest.warns(DeprecationWarning, match="store.admin.open_chunk"):
            with store.open_blob(h) as reader:
                assert reader is not None
        with pytest.raises(AttributeError):
            store.no_such_call  # noqa: B018 - only the listed names forward
