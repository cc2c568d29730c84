"""``kvshelf watch``: a real watcher process over a real inbox and store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tools_data import MODEL, OTHER, make_caches, same_reads, tokens_for

from kvshelf import open_store  # noqa: E402
from kvshelf.codecs import save_snapshot  # noqa: E402
from kvshelf.tools.watcher import parse_duration  # noqa: E402

SETTLE = "0.3s"


def portable(path: Path, n: int, seed: int, kind: str = "affine4", identity=MODEL, namespace: str = "") -> Path:
    ident = {"model_id": identity.model_id, "config_fingerprint": identity.config_fingerprint,
             "tokenizer_hash": identity.tokenizer_hash, "namespace": namespace}
    save_snapshot(path, tokens_for(n, seed), make_caches(kind, n, seed), identity=ident)
    return path


def drop(inbox: Path, name: str, data: bytes) -> None:
    """How a well-behaved producer delivers: write a hidden temp file, then rename it into place."""
    tmp = inbox / f".{name}.part"
    tmp.write_bytes(data)
    os.rename(tmp, inbox / name)


def start(store: Path, inbox: Path, *extra: str, env: dict[str, str] | None = None,
          settle: str = SETTLE) -> subprocess.Popen:
    env = {**os.environ, "KVSHELF_NO_PROGRESS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "kvshelf.tools.cli", "watch", str(inbox), "--store", str(store),
                             "--settle", settle, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(predicate, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"watcher exited early: {proc.returncode}\n{proc.stderr.read()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def trace_lines(trace: Path) -> list[str]:
    """The watcher's phase trace (``KVSHELF_TEST_WATCH_TRACE``): one ``<phase> <detail>`` line per step."""
    return trace.read_text().splitlines() if trace.exists() else []


def done(inbox: Path) -> list[str]:
    return sorted(p.name for p in (inbox / "done").glob("*.safetensors")) if (inbox / "done").exists() else []


def failed(inbox: Path) -> list[str]:
    return sorted(p.name for p in (inbox / "failed").glob("*.safetensors")) if (inbox / "failed").exists() else []


def sessions(store: Path, identity=MODEL) -> dict[str, str]:
    if not (store / "index").exists():
        return {}
    with open_store(store, identity=identity) as s:
        return {i.session_id: i.snapshot_id for i in s.sessions()}


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "1.5m", "2h", "1d", "250ms")] == [90, 90, 90, 7200, 86400, 0.25]
    assert parse_duration("0s", allow_zero=True) == 0
    for bad in ("", "soon", "-1s", "0s", "5 weeks"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_files_dropped_while_running_and_while_stopped_are_ingested_exactly_once(tmp_path) -> None:
    store, inbox, src = tmp_path / "store", tmp_path / "inbox", tmp_path / "src"
    inbox.mkdir()
    src.mkdir()
    a = portable(src / "a.safetensors", 70, 1).read_bytes()
    b = portable(src / "b.safetensors", 90, 2, kind="paged-affine").read_bytes()
    c = portable(src / "c.safetensors", 60, 3, kind="turbo").read_bytes()
    drop(inbox, "a.safetensors", a)  # arrived before the watcher started
    proc = start(store, inbox)
    try:
        wait_for(lambda: done(inbox) == ["a.safetensors"], proc=proc)
        drop(inbox, "b.safetensors", b)
        wait_for(lambda: done(inbox) == ["a.safetensors", "b.safetensors"], proc=proc)
        first = sessions(store)
        drop(inbox, "a.safetensors", a)  # the same file again: filed, but no second snapshot
        wait_for(lambda: len(done(inbox)) == 3, proc=proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "watch stopped: 3 ingested, 0 failed" in out
    assert sessions(store) == first and set(first) == {"a", "b"}
    drop(inbox, "c.safetensors", c)  # arrives while the watcher is down
    again = start(store, inbox, "--exit-when-idle", "1s", "--json")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert '"done": 1' in out
    now = sessions(store)
    assert set(now) == {"a", "b", "c"} and {k: now[k] for k in first} == first
    assert [p.name for p in inbox.glob("*.safetensors")] == []
    with open_store(store, identity=MODEL) as s:
        assert s.verify(deep=True) == []
        assert same_reads(s.restore("b").caches, make_caches("paged-affine", 90, 2))
        assert s.restore("c").tokens == tokens_for(60, 3)


def test_bad_files_land_in_failed_with_their_reason_and_nothing_in_the_store(tmp_path) -> None:
    store, inbox, src = tmp_path / "store", tmp_path / "inbox", tmp_path / "src"
    inbox.mkdir()
    src.mkdir()
    good = portable(src / "good.safetensors", 70, 1).read_bytes()
    drop(inbox, "truncated.safetensors", good[: len(good) // 2])
    flipped = bytearray(good)
    flipped[-7] ^= 0x10
    drop(inbox, "corrupted.safetensors", bytes(flipped))
    drop(inbox, "foreign.safetensors", portable(src / "f.safetensors", 70, 4, identity=OTHER).read_bytes())
    drop(inbox, "good.safetensors", good)
    (inbox / "notes.txt").write_text("not a snapshot")
    proc = start(store, inbox, "--model-id", MODEL.model_id, "--exit-when-idle", "1s")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err  # rejected files are problems found
    assert done(inbox) == ["good.safetensors"]
    assert failed(inbox) == ["corrupted.safetensors", "foreign.safetensors", "truncated.safetensors"]
    reason = {n: (inbox / "failed" / f"{n}.reason.txt").read_text() for n in failed(inbox)}
    assert reason["corrupted.safetensors"].startswith("CorruptData:") and "checksum" in reason["corrupted.safetensors"]
    assert reason["truncated.safetensors"].startswith("CorruptData:")
    assert reason["foreign.safetensors"].startswith("IdentityMismatch:") and "model_id" in reason["foreign.safetensors"]
    assert (inbox / "notes.txt").exists()  # not a candidate: left alone
    assert set(sessions(store)) == {"good"} and sessions(store, OTHER) == {}
    with open_store(store, identity=MODEL) as s:
        assert s.verify(deep=True) == []


def test_a_file_written_slowly_in_pieces_is_ingested_only_when_complete(tmp_path) -> None:
    """The writer waits on the watcher, not on the clock: each piece is written only after the watcher's trace shows
    it looked at that partial size twice (so it had the chance to take it), and right after each write the partial
    file's mtime is put ahead of the clock (a writer whose clock runs ahead). With a 60 s settle window, a partial
    file could only look settled if the writer stalled for a minute between its write and its utime — scheduling on
    a loaded machine cannot make that happen — so the watcher sees every partial size, takes none, and ingests the
    file once the writer, finished, dates it back."""
    store, inbox, src = tmp_path / "store", tmp_path / "inbox", tmp_path / "src"
    inbox.mkdir()
    src.mkdir()
    trace = tmp_path / "trace"
    data = portable(src / "slow.safetensors", 110, 5, kind="mla").read_bytes()
    proc = start(store, inbox, env={"KVSHELF_TEST_WATCH_TRACE": str(trace)}, settle="60s")
    target = inbox / "slow.safetensors"
    try:
        step = len(data) // 8 + 1
        with open(target, "wb") as fh:  # in place, under its final name
            for i in range(0, len(data), step):
                fh.write(data[i:i + step])
                fh.flush()
                size = min(i + step, len(data))
                ahead = time.time() + 3600
                os.utime(target, (ahead, ahead))
                wait_for(lambda: trace_lines(trace).count(f"seen slow.safetensors {size}") >= 2, proc=proc)
                assert not any(line.startswith("ingest ") for line in trace_lines(trace))
        old = time.time() - 120
        os.utime(target, (old, old))  # complete: its mtime is now older than the settle window
        wait_for(lambda: done(inbox) or failed(inbox), proc=proc)
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert done(inbox) == ["slow.safetensors"] and failed(inbox) == []
    with open_store(store, identity=MODEL) as s:
        assert s.restore("slow").tokens == tokens_for(110, 5)


def mid_ingest(tmp_path: Path, prefix: str, count: int, seed: int, kind: str):
    """A watcher over ``count`` queued files (file i: ``200 + 10 i`` tokens, seed ``seed + i``), once one is filed."""
    store, inbox, src = tmp_path / "store", tmp_path / "inbox", tmp_path / "src"
    inbox.mkdir()
    src.mkdir()
    names = [f"{prefix}{i}.safetensors" for i in range(count)]
    for i, name in enumerate(names):
        drop(inbox, name, portable(src / name, 200 + 10 * i, seed + i, kind=kind).read_bytes())
    proc = start(store, inbox)
    wait_for(lambda: len(done(inbox)) >= 1, proc=proc)
    return store, inbox, names, proc


def test_sigterm_mid_ingest_leaves_the_store_consistent(tmp_path) -> None:
    """SIGTERM lands while the second file is in hand, deterministically: the watcher holds each ingest until the
    test's release file exists (``KVSHELF_TEST_WATCH_HOLD``), the test signals once the trace shows file two in
    hand, and asserts from the trace that the signal landed mid-ingest; that file is finished, nothing new starts."""
    store, inbox, src = tmp_path / "store", tmp_path / "inbox", tmp_path / "src"
    inbox.mkdir()
    src.mkdir()
    trace, release = tmp_path / "trace", tmp_path / "release"
    names = [f"s{i}.safetensors" for i in range(6)]
    for i, name in enumerate(names):
        drop(inbox, name, portable(src / name, 200 + 10 * i, 10 + i, kind="affine8-start").read_bytes())
    proc = start(store, inbox, env={"KVSHELF_TEST_WATCH_TRACE": str(trace), "KVSHELF_TEST_WATCH_HOLD": str(release)})
    wait_for(lambda: any(line.startswith("ingest ") for line in trace_lines(trace)), proc=proc)
    release.write_text("")  # one release: the first file goes through, the second waits in hand for another
    wait_for(lambda: sum(line.startswith("ingest ") for line in trace_lines(trace)) >= 2, proc=proc)
    in_hand = [line.split()[1] for line in trace_lines(trace) if line.startswith("ingest ")][-1]
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: any(line.startswith("signal ") for line in trace_lines(trace)), proc=proc)
    release.write_text("")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    signals = [line for line in trace_lines(trace) if line.startswith("signal ")]
    assert signals == [f"signal SIGTERM in-hand={in_hand}"], (signals, trace_lines(trace))  # it landed mid-ingest
    assert f"filed done {in_hand}" in trace_lines(trace)  # the file in hand was finished
    filed = done(inbox)
    assert in_hand in filed and len(filed) == 2  # ... and nothing new was started
    waiting = sorted(p.name for p in inbox.glob("*.safetensors"))
    assert sorted(filed + waiting) == names and failed(inbox) == []
    stored = sessions(store)
    assert set(stored) == {n.removesuffix(".safetensors") for n in filed}  # committed iff filed
    with open_store(store, identity=MODEL) as s:
        assert s.verify(deep=True) == []
    again = start(store, inbox, "--exit-when-idle", "1s")
    _out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and done(inbox) == names, err
    final = sessions(store)
    assert set(final) == {n.removesuffix(".safetensors") for n in names}
    assert {k: final[k] for k in stored} == stored  # nothing ingested twice
    with open_store(store, identity=MODEL) as s:
        assert s.verify(deep=True) == []
        for i, name in enumerate(names):
            assert s.restore(name.removesuffix(".safetensors")).tokens == tokens_for(200 + 10 * i, 10 + i)


def test_sigkill_mid_ingest_then_restart_ingests_each_file_once(tmp_path) -> None:
    store, inbox, names, proc = mid_ingest(tmp_path, "k", 5, 30, "mla")
    proc.kill()  # no chance to finish: a save or a move may be cut anywhere
    proc.communicate(timeout=60)
    before = sessions(store)
    assert set(before) >= {n.removesuffix(".safetensors") for n in done(inbox)}
    again = start(store, inbox, "--exit-when-idle", "1s")
    _out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert done(inbox) == names and failed(inbox) == []
    after = sessions(store)
    assert set(after) == {n.removesuffix(".safetensors") for n in names}
    assert {k: after[k] for k in before} == before  # a file committed before the kill was not saved again
    with open_store(store, identity=MODEL) as s:
        s.gc(dry_run=False)  # crash residue of the killed save, if any
        assert s.verify(deep=True) == []
        for i, name in enumerate(names):
            assert s.restore(name.removesuffix(".safetensors")).tokens == tokens_for(200 + 10 * i, 30 + i)
