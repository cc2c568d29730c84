"""The store never takes ``kvshelf serve`` down, and stopping it never damages the store.

SIGTERM with write-behinds in flight flushes them (within ``--flush-timeout``, else abandons them and exits);
SIGKILL in the middle of write-behinds leaves a store that ``kvshelf gc`` + ``kvshelf verify --deep`` find clean;
a full filesystem and a corrupted chunk cost the disk tier only: the replies are those of a server without a store.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess

import pytest

from serve_harness import Server, conversation, kvshelf_cli
from store_cases import flip_chunk_byte
from tiny_model_dir import make_model_dir, words

from kvshelf import open_store
from kvshelf.mlx_lm import model_identity

SYSTEM = words(200)
TURNS = ["hello world what is the cache", "and the disk of the store", "one more short question"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def final_tokens(reply: dict) -> int:
    return reply["prompt_tokens"] + reply["completion_tokens"]


def assert_store_clean(store) -> None:
    gc = kvshelf_cli("gc", "--store", str(store))
    assert gc.returncode == 0, gc.stdout + gc.stderr
    verify = kvshelf_cli("verify", "--deep", "--store", str(store), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_sigterm_mid_write_behind_flushes_every_pending_write(model, tmp_path):
    store = tmp_path / "store"
    with open_store(store, admin=True) as admin:
        with admin.save_gate(exclusive=True):  # every write-behind waits at the gate: in flight, not written
            server = Server(model, store, tmp_path / "s.log")
            try:
                r = server.chat(conversation(SYSTEM, TURNS[:1], []))
                queued = server.wait_log(rf"kvshelf write-behind queued tokens={final_tokens(r)}\b")
                server.signal(signal.SIGTERM)
                server.wait_log(r"kvshelf serve: signal 15, stopping")
                assert server.proc.poll() is None  # still flushing
                assert "write-behind saved" not in server.log()
            except BaseException:
                server.kill()
                raise
        assert server.wait() == 0  # the gate opened: the writes went through, then the process left
    n_queued = len(re.findall(r"kvshelf write-behind queued tokens=", server.log()))
    assert n_queued >= len(queued)
    assert re.search(rf"write-behind flushed: {n_queued} saved, 0 failed", server.log()), server.log()
    with open_store(store, identity=model_identity(model)) as s:
        assert final_tokens(r) in {info.length for info in s.sessions()}
    assert_store_clean(store)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_flush_on_a_signal_is_bounded_by_the_flush_timeout(model, tmp_path, sig):
    store = tmp_path / "store"
    with open_store(store, admin=True) as admin, admin.save_gate(exclusive=True):
        server = Server(model, store, tmp_path / "s.log", extra=("--flush-timeout", "0.5"))
        try:
            r = server.chat(conversation(SYSTEM, TURNS[:1], []))
            server.wait_log(rf"kvshelf write-behind queued tokens={final_tokens(r)}\b")
            server.signal(sig)
            assert server.wait() == 1  # left while the gate was still shut: the writes were abandoned
        except BaseException:
            server.kill()
            raise
    assert "write-behind abandoned at the deadline" in server.log()
    assert_store_clean(store)


@pytest.mark.slow
def test_sigkill_mid_write_behind_leaves_a_consistent_store(tmp_path):
    """Large caches (16 KiB per token, a long prompt: ~10 MB per write), killed as soon as the k-th write-behind of
    a request (system checkpoint, user checkpoint, final) is queued, i.e. while it is being written."""
    model = make_model_dir(tmp_path / "kv", "llama-kv", seed=3)
    store = tmp_path / "store"
    with Server(model, None, tmp_path / "ref.log") as ref:
        for k in (1, 2, 3):
            server = Server(model, store, tmp_path / f"kill{k}.log")
            try:
                server.chat(conversation(words(600, salt=k), [TURNS[0]], []), max_tokens=4)
                server.wait_log(r"kvshelf write-behind queued tokens=", count=k)
            finally:
                server.kill()
            assert_store_clean(store)
        with Server(model, store, tmp_path / "after.log") as after:  # what was committed is served
            for k in (1, 2, 3):
                msgs = conversation(words(600, salt=k), [TURNS[1]], [])
                assert after.chat(msgs, max_tokens=4)["text"] == ref.chat(msgs, max_tokens=4)["text"]


@contextlib.contextmanager
def small_filesystem(path, size: str = "2m"):
    """A tmpfs of ``size`` at ``path`` (yields True), or a plain directory when mounting is not allowed (False)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                             capture_output=True, check=False).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path) -> None:
    with open(os.path.join(path, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_a_full_filesystem_costs_the_disk_tier_only(model, tmp_path):
    with small_filesystem(tmp_path / "fs") as mounted:
        store = tmp_path / "fs" / "store"
        env = None if mounted else {"KVSHELF_FAULT_ENOSPC_AFTER": "0"}
        with Server(model, None, tmp_path / "ref.log") as ref, \
                Server(model, store, tmp_path / "s.log", env=env) as server:
            if mounted:
                fill(tmp_path / "fs")  # the store is open, its filesystem now full
            replies = []
            for n in (1, 2, 3):
                msgs = conversation(SYSTEM, TURNS[:n], replies)
                r = server.chat(msgs)
                assert r["text"] == ref.chat(msgs)["text"]
                replies.append(r["text"])
            server.wait_log(r"kvshelf write-behind failed .*StoreFull")
            assert "write-behind saved" not in server.log()
            assert [p["source"] for p in server.prefix_lines()] == ["none", "ram", "ram"]


def test_a_corrupted_chunk_is_a_miss_and_the_replies_stay_those_of_a_cold_server(model, tmp_path):
    store = tmp_path / "store"
    msgs1 = conversation(SYSTEM, TURNS[:1], [])
    with Server(model, store, tmp_path / "first.log") as first:
        r1 = first.chat(msgs1)
        first.wait_log(rf"kvshelf write-behind saved tokens={final_tokens(r1)}\b")
    with open_store(store, admin=True) as admin:
        chunks = [h for h, _ in admin.admin.iter_chunks()]
        assert chunks
        for h in chunks:  # one flipped bit inside each chunk's tensor data: only the hash can tell
            flip_chunk_byte(admin, h)
    with Server(model, None, tmp_path / "cold.log") as cold, Server(model, store, tmp_path / "s.log") as server:
        msgs2 = conversation(SYSTEM, TURNS[:2], [r1["text"]])
        assert server.chat(msgs2)["text"] == cold.chat(msgs2)["text"]
        server.wait_log(r"kvshelf disk prefix failed, serving from RAM: CorruptData")
        assert server.prefix_lines()[-1]["source"] == "none"
        msgs3 = conversation(SYSTEM, TURNS[:3], [r1["text"], "a reply"])
        assert server.chat(msgs3)["text"] == cold.chat(msgs3)["text"]
