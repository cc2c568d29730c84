"""The ``kvshelf`` command line through a real subprocess on real stores: human and --json output, exit codes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tools_data import (
    MODEL,
    make_caches,
    private_copy,
    run_cli,
    run_json,
    same_reads,
    template_store,
    tokens_for,
)

from kvshelf import open_store  # noqa: E402
from kvshelf.store.index.schema import ChunkRef  # noqa: E402

SUBCOMMANDS = ["demo", "ls", "show", "stats", "verify", "gc", "compact", "export", "import", "delete", "rebuild-index", "watch"]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return template_store(tmp_path_factory, "cli")


@pytest.fixture
def fresh_store(store_dir, tmp_path) -> Path:
    """A private copy of the module's store, for commands that change it."""
    return private_copy(store_dir, tmp_path)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help_with_store_and_json(command: str) -> None:
    proc = run_cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"usage: kvshelf {command}" in proc.stdout
    assert "--store DIR" in proc.stdout and "--json" in proc.stdout


def test_usage_errors_exit_2(store_dir) -> None:
    assert run_cli("bogus").returncode == 2
    assert run_cli("show", "--store", str(store_dir)).returncode == 2  # missing SESSION
    proc = run_cli("compact", "--cold-after", "soon", "--store", str(store_dir))
    assert proc.returncode == 2 and "not a duration" in proc.stderr


def test_missing_store_is_a_problem_not_a_crash(tmp_path) -> None:
    proc = run_cli("ls", "--store", str(tmp_path / "nowhere"))
    assert proc.returncode == 1 and "no kvshelf store" in proc.stderr
    assert not (tmp_path / "nowhere").exists()


def test_default_store_comes_from_the_environment(store_dir) -> None:
    doc = run_json("stats", env={"KVSHELF_STORE": str(store_dir)})
    assert doc["store"] == str(store_dir)


def test_ls_lists_every_identity_and_namespace(store_dir) -> None:
    doc = run_json("ls", "--store", str(store_dir))
    rows = {(r["model_id"], r["namespace"], r["session_id"]): r for r in doc["sessions"]}
    assert set(rows) == {
        (MODEL.model_id, "", s) for s in ("s-mla", "s-affine4", "s-affine8-start", "s-turbo", "s-paged-f32",
                                          "s-paged-affine", "s-mla-copy")
    } | {(MODEL.model_id, "tenant", "s-tenant"), ("other-model", "", "s-other")}
    mla = rows[(MODEL.model_id, "", "s-mla")]
    assert mla["tokens"] == 70 and mla["kinds"] == ["mla-dsa"] and mla["minimum_reusable_offset"] == 0
    # s-mla, s-mla-copy and s-tenant hold identical data: every byte of s-mla is shared
    assert mla["bytes_own"] == 0 and mla["bytes_shared"] > 0
    assert rows[(MODEL.model_id, "", "s-paged-affine")]["kinds"] == ["latent-paged"]
    assert rows[(MODEL.model_id, "", "s-paged-affine")]["formats"] == ["affine:4:32"]
    assert rows[(MODEL.model_id, "", "s-turbo")]["formats"] == ["turbo:8:3"]
    only = run_json("ls", "--store", str(store_dir), "--model-id", "other-model")
    assert [r["session_id"] for r in only["sessions"]] == ["s-other"]

    human = run_cli("ls", "--store", str(store_dir))
    assert human.returncode == 0
    assert "9 session(s)" in human.stdout and "s-paged-affine" in human.stdout and "tenant" in human.stdout


def test_show_reads_the_header_without_tensors(store_dir) -> None:
    doc = run_json("show", "s-paged-affine", "--store", str(store_dir))
    assert doc["session_id"] == "s-paged-affine" and doc["tokens"] == 120
    assert [c["kind"] for c in doc["caches"]] == ["latent-paged", "latent-paged"]
    pages = doc["caches"][0]["pages"]
    assert pages["block_size"] == 16 and pages["block_table"] == list(range(8)) and pages["num_blocks"] > 8
    assert all(c["encoding"] == "raw" for c in doc["chunks"])
    again = run_json("show", doc["snapshot_id"], "--store", str(store_dir))
    assert again["snapshot_id"] == doc["snapshot_id"]
    human = run_cli("show", "s-turbo", "--store", str(store_dir))
    assert human.returncode == 0 and "latent-encoded" in human.stdout and "turbo:8:3" in human.stdout
    missing = run_cli("show", "nope", "--store", str(store_dir))
    assert missing.returncode == 1 and "no session or snapshot 'nope'" in missing.stderr


def test_stats_ratios_are_the_documented_quotients(store_dir) -> None:
    doc = run_json("stats", "--store", str(store_dir))
    assert doc["snapshots"] == 9 and doc["identities"] == 2 and doc["namespaces"] == 2
    assert doc["dedup_ratio"] == round(doc["referenced_bytes"] / doc["payload_bytes"], 4)
    assert doc["dedup_ratio"] > 1.0  # three sessions share one body
    assert doc["compression_ratio"] == round(doc["payload_bytes"] / doc["stored_bytes"], 4)
    assert doc["orphan_count"] == 0 and doc["chunks"] > 0
    budget = run_json("stats", "--store", str(store_dir), "--max-bytes", str(doc["stored_bytes"] * 2))
    assert budget["budget_use"] == 0.5
    human = run_cli("stats", "--store", str(store_dir))
    assert human.returncode == 0 and "dedup_ratio" in human.stdout


def _blob_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "packs").glob("*.pack"))


def test_orphans_are_listed_by_verify_as_handled_exit_0_and_gc_reclaims_them(fresh_store) -> None:
    """An orphan is residue nothing reads (a heal, a re-save, a crash): verify lists it, needs no operator (exit 0,
    so a cron alert stays quiet), and gc reclaims it; stats still counts it."""
    victim = _blob_files(fresh_store)[0]
    orphan = fresh_store / "packs" / ("f" * 32 + ".pack")  # crash residue: a pack nobody indexed
    orphan.parent.mkdir(mode=0o700, exist_ok=True)
    shutil.copy(victim, orphan)
    stats = run_json("stats", "--store", str(fresh_store), expect_rc=1)
    assert stats["orphan_count"] == 1
    found = run_json("verify", "--store", str(fresh_store))
    assert [p["kind"] for p in found["problems"]] == ["orphan-object"]
    assert found["needs_operator"] == 0 and found["handled"] == 1 and not found["problems"][0]["needs_operator"]
    listed = run_cli("verify", "--store", str(fresh_store))
    assert listed.returncode == 0 and "1 finding(s) already handled, nothing lost" in listed.stdout
    dry = run_json("gc", "--dry-run", "--store", str(fresh_store))
    assert dry["objects"] == 1 and dry["dry_run"] and orphan.exists()
    done = run_json("gc", "--store", str(fresh_store))
    assert done["objects"] == 1 and done["bytes"] == victim.stat().st_size and not orphan.exists()
    clean = run_cli("verify", "--store", str(fresh_store))
    assert clean.returncode == 0 and "no problems found" in clean.stdout


def test_verify_deep_rehashes_and_names_the_sessions(fresh_store) -> None:
    with open_store(fresh_store, identity=MODEL) as store:
        sid = store.sessions(namespace="")[0]
        manifest = store.admin.manifest(store.restore("s-turbo").snapshot_id)
    ref: ChunkRef = next(r for r in manifest.chunks if r.start == 64)  # not shared with any other session
    with open_store(fresh_store, identity=MODEL) as store:
        name, offset, length = store.admin.chunk_location(ref.hash)
    path = fresh_store / name
    data = bytearray(path.read_bytes())
    data[offset + length - 5] ^= 0x40  # one flipped bit in tensor data: same size, so only a re-hash sees it
    path.write_bytes(bytes(data))
    assert sid is not None
    shallow = run_json("verify", "--store", str(fresh_store))
    assert shallow["problems"] == []
    deep = run_json("verify", "--deep", "--store", str(fresh_store), expect_rc=1)
    assert [(p["kind"], p["session_id"]) for p in deep["problems"]] == [("corrupt-chunk", "s-turbo")]
    human = run_cli("verify", "--deep", "--store", str(fresh_store))
    # the first deep verify marked the copy bad (the next save writes a fresh one): reported as such from then on
    assert human.returncode == 1 and "s-turbo" in human.stdout and "bad-chunk" in human.stdout


def test_export_import_round_trip_is_bit_identical_and_idempotent(store_dir, tmp_path) -> None:
    target = tmp_path / "out" / "chat.safetensors"
    target.parent.mkdir()
    doc = run_json("export", "s-paged-affine", str(target), "--store", str(store_dir))
    assert doc["tokens"] == 120 and target.stat().st_mode & 0o777 == 0o600
    other = tmp_path / "other-store"
    first = run_json("import", str(target), "--store", str(other))
    assert [r["status"] for r in first["results"]] == ["imported"] and first["failed"] == 0
    second = run_cli("import", str(target), "--store", str(other))
    assert second.returncode == 0 and "already-present" in second.stdout
    with open_store(other, identity=MODEL) as store:
        assert [s.session_id for s in store.sessions()] == ["chat"]
        restored = store.restore("chat")
    assert restored.tokens == tokens_for(120, 6)
    assert same_reads(restored.caches, make_caches("paged-affine", 120, 6, trim=20))


def test_export_of_an_ambiguous_session_needs_the_identity(store_dir, tmp_path) -> None:
    out = tmp_path / "o.safetensors"
    ok = run_json("export", "s-other", str(out), "--store", str(store_dir))
    assert ok["model_id"] == "other-model"
    proc = run_cli("export", "s-mla", str(out), "--store", str(store_dir), "--namespace", "tenant")
    assert proc.returncode == 1 and "no session or snapshot 's-mla'" in proc.stderr


def test_import_refuses_bad_files_and_keeps_the_store_clean(store_dir, tmp_path) -> None:
    good = tmp_path / "good.safetensors"
    run_json("export", "s-affine4", str(good), "--store", str(store_dir))
    bad = tmp_path / "bad.safetensors"
    data = bytearray(good.read_bytes())
    data[-3] ^= 0x01
    bad.write_bytes(bytes(data))
    short = tmp_path / "short.safetensors"
    short.write_bytes(good.read_bytes()[:-100])
    other = tmp_path / "other-store"
    doc = run_json("import", str(bad), str(short), str(good), "--store", str(other), expect_rc=1)
    status = {Path(r["file"]).name: r["status"] for r in doc["results"]}
    assert status == {"bad.safetensors": "failed", "short.safetensors": "failed", "good.safetensors": "imported"}
    assert "CorruptData" in doc["results"][0]["detail"]
    wrong = run_json("import", str(good), "--store", str(other), "--model-id", "someone-else", expect_rc=1)
    assert "IdentityMismatch" in wrong["results"][0]["detail"]
    listing = run_json("ls", "--store", str(other))
    assert [r["session_id"] for r in listing["sessions"]] == ["good"]
    assert run_json("verify", "--deep", "--store", str(other))["problems"] == []


def test_rebuild_index_from_blobs_alone(fresh_store) -> None:
    before = run_json("ls", "--store", str(fresh_store))
    shutil.rmtree(fresh_store / "index")
    doc = run_json("rebuild-index", "--store", str(fresh_store))
    assert doc["snapshots"] == 9
    after = run_json("ls", "--store", str(fresh_store))
    key = lambda r: (r["model_id"], r["namespace"], r["session_id"], r["tokens"], r["snapshot_id"])  # noqa: E731
    assert sorted(map(key, after["sessions"])) == sorted(map(key, before["sessions"]))
    assert run_json("verify", "--deep", "--store", str(fresh_store))["problems"] == []


def test_compact_dry_run_then_real_through_the_cli(fresh_store) -> None:
    plan = run_json("compact", "--dry-run", "--cold-after", "0s", "--store", str(fresh_store))
    assert plan["dry_run"] and plan["bytes_before"] > 0
    steps = {s["name"]: s for s in plan["steps"]}
    assert steps["recompress"]["count"] > 0 and steps["densify"]["count"] == 2
    assert run_json("stats", "--store", str(fresh_store))["compressed_chunks"] == 0  # nothing changed
    done = run_json("compact", "--cold-after", "0s", "--store", str(fresh_store))
    assert not done["dry_run"] and done["bytes_after"] < done["bytes_before"]
    assert done["ratio"] == pytest.approx(done["bytes_before"] / done["bytes_after"], rel=1e-3)
    stats = run_json("stats", "--store", str(fresh_store))
    assert stats["compressed_chunks"] > 0 and stats["compression_ratio"] > 1.0
    assert run_json("verify", "--deep", "--store", str(fresh_store))["problems"] == []
    human = run_cli("compact", "--dry-run", "--store", str(fresh_store))
    assert human.returncode == 0 and "compaction plan (dry run)" in human.stdout


def test_demo_runs_on_the_given_store_and_ls_sees_its_sessions(tmp_path) -> None:
    root = tmp_path / "demo-store"
    doc = run_json("demo", env={"KVSHELF_STORE": str(root)}, timeout=300)
    assert doc["store"] == str(root) and doc["logits_equal"] is True and doc["tokens_reused"] > 0
    listing = run_json("ls", "--store", str(root), "--namespace", doc["namespace"])
    assert sorted(r["session_id"] for r in listing["sessions"])[:4] == ["chat-0", "chat-1", "chat-2", "chat-3"]
    assert run_json("verify", "--store", str(root))["problems"] == []
