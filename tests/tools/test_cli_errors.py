"""The CLI never shows a traceback: every refusal is one ``error:`` line on stderr and exit 1 (usage errors 2),
and with ``--json`` an ``{"error", "message"}`` document on stdout (issue 12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tools_data import (
    MODEL,
    make_caches,
    private_copy,
    run_cli,
    template_store,
    tokens_for,
)

from kvshelf import open_store


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return template_store(tmp_path_factory, "cli-errors", kinds=("mla",), other_identity=False)


def refused(proc, *, rc: int = 1, says: str = "") -> None:
    assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    assert "error" in proc.stderr.lower(), proc.stderr
    assert says in proc.stderr, proc.stderr


def test_messages_with_brackets_are_printed_not_parsed_as_markup(store_dir, tmp_path) -> None:
    """A session id like ``a[/b]`` used to crash rich's markup parser (MarkupError traceback) on every message."""
    root = private_copy(store_dir, tmp_path)
    with open_store(root, identity=MODEL, chunk_tokens=32) as store:
        store.save("a[/b]", tokens_for(40, 3), make_caches("mla", 40, 3))
    refused(run_cli("show", "x[/y]", "--store", str(root)), says="x[/y]")
    proc = run_cli("ls", "--store", str(root))
    assert proc.returncode == 0 and "a[/b]" in proc.stdout, proc.stderr
    out = tmp_path / "a.safetensors"
    proc = run_cli("export", "a[/b]", str(out), "--store", str(root))
    assert proc.returncode == 0 and "a[/b]" in proc.stdout, proc.stderr


def test_a_missing_or_bogus_store_is_exit_1(tmp_path) -> None:
    (tmp_path / "file").write_text("not a store")
    for store in (tmp_path / "nope", tmp_path / "file"):
        for command in (["ls"], ["verify", "--deep"], ["stats"], ["show", "s"], ["gc"]):
            refused(run_cli(*command, "--store", str(store)))


def test_store_errors_are_exit_1_in_human_and_json_modes(store_dir, tmp_path) -> None:
    refused(run_cli("show", "zz", "--store", str(store_dir)), says="SnapshotNotFound")
    proc = run_cli("show", "zz", "--store", str(store_dir), "--json")
    refused(proc)
    doc = json.loads(proc.stdout)
    assert doc["error"] == "SnapshotNotFound" and "zz" in doc["message"]


def test_export_onto_a_directory_is_exit_1(store_dir, tmp_path) -> None:
    (tmp_path / "dir.safetensors").mkdir()
    refused(run_cli("export", "s-mla", str(tmp_path / "dir.safetensors"), "--store", str(store_dir)),
            says="FileAccessError")
    refused(run_cli("export", "s-mla", str(tmp_path / "no" / "such" / "x.safetensors"), "--store", str(store_dir)),
            says="FileMissing")


def test_hostile_identity_arguments_are_exit_1(store_dir, tmp_path) -> None:
    """Non-UTF-8 bytes on the command line arrive as lone surrogates (surrogateescape): refused, no traceback."""
    out = tmp_path / "x.safetensors"
    refused(run_cli("export", "s-mla", str(out), "--model-id", "m\udcff", "--store", str(store_dir)))
    refused(run_cli("export", "s\udcff", str(out), "--store", str(store_dir)))
    assert not out.exists()


def test_hostile_files_to_import_are_reported_exit_1(store_dir, tmp_path) -> None:
    root = private_copy(store_dir, tmp_path)
    files = []
    for name, content in (("empty", b""), ("junk", b"\xff" * 100), ("len", (2**63).to_bytes(8, "little"))):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        files.append(str(path))
    proc = run_cli("import", *files, str(tmp_path), "--store", str(root), "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["failed"] == 4 and all(r["status"] == "failed" for r in doc["results"])


def test_usage_errors_are_exit_2(store_dir) -> None:
    for args in (["compact", "--level", "99"], ["nosuch"], ["watch", "x", "--settle", "soon"]):
        proc = run_cli(*args, "--store", str(store_dir))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
