"""Audit of issue 5 behaviour the other tools tests leave unproven: the progress bar on a terminal (and silence when
piped, without the tests' KVSHELF_NO_PROGRESS switch), the installed ``kvshelf`` console script itself, ``show``
reading no tensor bytes, private modes after every tool that writes, ``watch --compact-every``, and a SIGTERM that
provably lands while a file is in hand."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tools_data import MODEL, make_caches, populate, run_cli, run_json, same_reads, tokens_for

from kvshelf import open_store  # noqa: E402
from kvshelf.codecs import save_snapshot  # noqa: E402


@pytest.fixture(scope="module")
def populated(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("audit") / "store"
    populate(root, kinds=("mla", "paged-affine"), other_identity=False)
    return root


@pytest.fixture
def store_copy(populated, tmp_path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(populated, root)
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSHELF_NO_PROGRESS"}
    env.update(TERM="xterm-256color", COLUMNS="100")
    env.pop("NO_COLOR", None)
    return env


def _run_with_tty_stderr(args: list[str], timeout: float = 120) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (stdout piped); returns (rc, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvshelf.tools.cli", *args], stdout=subprocess.PIPE,
                            stderr=slave, env=_env())
    os.close(slave)
    seen = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([master], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk and proc.poll() is not None:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
        assert time.monotonic() < deadline, "CLI did not finish"
    out = proc.stdout.read().decode()
    proc.stdout.close()
    os.close(master)
    return proc.wait(), out, seen.decode(errors="replace")


@pytest.mark.parametrize("args", [["verify", "--deep"], ["rebuild-index"], ["compact", "--dry-run"]])
def test_long_work_shows_a_progress_bar_on_a_terminal_and_nothing_when_piped(store_copy, args) -> None:
    rc, out, terminal = _run_with_tty_stderr([*args, "--store", str(store_copy)])
    assert rc == 0, (out, terminal)
    description = {"verify": "verifying", "rebuild-index": "rebuilding the index", "compact": "compacting"}[args[0]]
    assert description in terminal, terminal
    assert "\x1b[" in terminal and "\u2501" in terminal  # a drawn bar (cursor control, bar glyphs), not a text line
    piped = subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", *args, "--store", str(store_copy)],
                           capture_output=True, text=True, env=_env(), timeout=120)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr


def test_the_installed_console_script_is_the_cli(populated) -> None:
    script = Path(sys.executable).with_name("kvshelf")
    assert script.exists(), f"no console script next to {sys.executable}"
    done = subprocess.run([str(script), "stats", "--json", "--store", str(populated)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "KVSHELF_NO_PROGRESS": "1"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == run_json("stats", "--store", str(populated))
    bad = subprocess.run([str(script), "bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2


def test_show_and_ls_read_no_tensor_bytes(store_copy) -> None:
    """With every chunk file gone, show and ls still answer in full (verify, which reads blobs, does not)."""
    expected = run_json("show", "s-paged-affine", "--store", str(store_copy))
    for chunk in (store_copy / "packs").glob("*.pack"):
        chunk.unlink()
    assert run_json("show", "s-paged-affine", "--store", str(store_copy)) == expected
    listing = run_json("ls", "--store", str(store_copy))
    assert {r["session_id"] for r in listing["sessions"]} == {"s-mla", "s-paged-affine", "s-mla-copy", "s-tenant"}
    row = next(r for r in listing["sessions"] if r["session_id"] == "s-paged-affine")
    assert row["tokens"] == 80 and row["formats"] == ["affine:4:32"]
    assert run_cli("verify", "--store", str(store_copy)).returncode == 1


def _modes(root: Path) -> list[str]:
    wrong = []
    for base, dirs, files in os.walk(root):
        if stat.S_IMODE(os.stat(base).st_mode) != 0o700:
            wrong.append(f"{base}: {oct(stat.S_IMODE(os.stat(base).st_mode))}")
        for f in files:
            mode = stat.S_IMODE(os.stat(os.path.join(base, f)).st_mode)
            if mode != 0o600:
                wrong.append(f"{os.path.join(base, f)}: {oct(mode)}")
    return wrong


def test_files_stay_0600_and_dirs_0700_after_every_tool_that_writes(store_copy, tmp_path) -> None:
    old = os.umask(0o022)
    try:
        assert run_cli("compact", "--cold-after", "0s", "--store", str(store_copy)).returncode == 0
        assert _modes(store_copy) == []
        with open_store(store_copy, identity=MODEL) as store:
            assert any(store.admin.chunk_info(r.hash).encoding == "zstd"
                       for r in store.admin.manifest(store.restore("s-mla").snapshot_id).chunks)
        for name in ("data.mdb", "lock.mdb"):
            os.unlink(store_copy / "index" / name)
        assert run_cli("rebuild-index", "--store", str(store_copy)).returncode == 0
        assert run_cli("gc", "--store", str(store_copy)).returncode == 0
        assert _modes(store_copy) == []
        out = tmp_path / "x.safetensors"
        assert run_cli("export", "s-mla", str(out), "--store", str(store_copy)).returncode == 0
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
        fresh = tmp_path / "fresh"
        assert run_cli("import", str(out), "--store", str(fresh)).returncode == 0
        assert _modes(fresh) == []
    finally:
        os.umask(old)


def test_watch_compact_every_compacts_between_ingests(tmp_path) -> None:
    store, inbox = tmp_path / "store", tmp_path / "inbox"
    inbox.mkdir()
    ident = {"model_id": MODEL.model_id, "config_fingerprint": MODEL.config_fingerprint,
             "tokenizer_hash": MODEL.tokenizer_hash, "namespace": ""}
    save_snapshot(inbox / "w.safetensors", tokens_for(90, 3), make_caches("mla", 90, 3), identity=ident)
    done = subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", "watch", str(inbox), "--store", str(store),
                           "--settle", "0.2s", "--compact-every", "0.3s", "--exit-when-idle", "2s", "--json"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "KVSHELF_NO_PROGRESS": "1"})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["done"] == 1 and doc["failed"] == 0 and doc["compactions"] >= 1, doc
    with open_store(store, identity=MODEL) as s:
        assert same_reads(s.restore("w").caches, make_caches("mla", 90, 3))
        assert s.verify(deep=True) == []


def _trace(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_sigterm_while_a_file_is_in_hand_finishes_it(tmp_path) -> None:
    """SIGTERM is sent while the watcher holds the inbox file in hand (its ingest waits on the test's release file,
    ``KVSHELF_TEST_WATCH_HOLD``, so the moment is certain, not raced): it must finish that file (committed, moved to
    done/, exact), log the signal before the ingest, exit 0, and leave no residue."""
    store, inbox = tmp_path / "store", tmp_path / "inbox"
    inbox.mkdir()
    ident = {"model_id": MODEL.model_id, "config_fingerprint": MODEL.config_fingerprint,
             "tokenizer_hash": MODEL.tokenizer_hash, "namespace": ""}
    n, seed = 3000, 5
    src = tmp_path / "big.safetensors"
    save_snapshot(src, tokens_for(n, seed), make_caches("mla", n, seed, layers=24), identity=ident)
    os.rename(src, inbox / "big.safetensors")
    target = str(inbox / "big.safetensors")
    trace, release = tmp_path / "trace", tmp_path / "release"
    proc = subprocess.Popen([sys.executable, "-m", "kvshelf.tools.cli", "watch", str(inbox), "--store", str(store),
                             "--settle", "0.2s"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "KVSHELF_NO_PROGRESS": "1", "KVSHELF_TEST_WATCH_TRACE": str(trace),
                                 "KVSHELF_TEST_WATCH_HOLD": str(release)})
    deadline = time.monotonic() + 60
    while "ingest big.safetensors" not in _trace(trace):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the watcher never took the file in hand"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    while not any(line.startswith("signal ") for line in _trace(trace)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline + 60, "the signal was never handled"
        time.sleep(0.02)
    assert "signal SIGTERM in-hand=big.safetensors" in _trace(trace)
    assert not (inbox / "done" / "big.safetensors").exists()
    release.write_text("")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "received SIGTERM" in err and "ingested big.safetensors" in err, err
    assert err.index("received SIGTERM") < err.index("ingested big.safetensors"), err
    assert (inbox / "done" / "big.safetensors").exists() and not Path(target).exists()
    with open_store(store, identity=MODEL) as s:
        r = s.restore("big")
        assert r.tokens == tokens_for(n, seed)
        assert same_reads(r.caches, make_caches("mla", n, seed, layers=24))
        assert s.verify(deep=True) == []
        assert s.gc(dry_run=True).orphan_objects == []
    assert not (store / "tmp").exists() or list((store / "tmp").iterdir()) == []


def test_human_output_of_gc_rebuild_index_and_watch(store_copy, tmp_path) -> None:
    """The subcommands whose human (non --json) output no other test reads."""
    dry = run_cli("gc", "--dry-run", "--store", str(store_copy))
    assert dry.returncode == 0 and dry.stdout.strip() == "would remove 0 object(s), 0 B", dry.stdout
    rebuilt = run_cli("rebuild-index", "--store", str(store_copy))
    assert rebuilt.returncode == 0 and "rebuilt index" in rebuilt.stdout, rebuilt.stdout
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    watched = run_cli("watch", str(inbox), "--store", str(store_copy), "--settle", "0.2s", "--exit-when-idle", "0.5s")
    assert watched.returncode == 0 and watched.stdout.strip() == "watch stopped: 0 ingested, 0 failed", watched.stdout
