"""Fail fast: a start-up mistake ends ``kvshelf serve`` with a message naming the problem and a non-zero exit,
before it listens (the port stays closed) — never a server answering every request with an error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from serve_harness import LISTENING_LINE, server_env
from tiny_model_dir import make_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def start(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, None]:
    proc = subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                           *args], env=server_env(), capture_output=True, text=True, timeout=120, check=False,
                          cwd=str(tmp_path))
    assert not LISTENING_LINE.search(proc.stdout + proc.stderr), "the server listened before failing"
    return proc, None


def test_a_model_path_that_does_not_exist(tmp_path):
    proc, _ = start(tmp_path, "--model", str(tmp_path / "no-such-model"), "--store", str(tmp_path / "s"))
    assert proc.returncode == 1 and "cannot start: --model" in proc.stderr and "no such directory" in proc.stderr


def test_a_directory_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    proc, _ = start(tmp_path, "--model", str(tmp_path / "empty"), "--store", str(tmp_path / "s"))
    assert proc.returncode == 1 and "no config.json" in proc.stderr


def test_a_model_whose_weights_do_not_load(model, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")  # no tensors at all
    proc, _ = start(tmp_path, "--model", str(broken), "--store", str(tmp_path / "s"))
    assert proc.returncode == 1 and "the model does not load" in proc.stderr, proc.stderr
    assert "generation thread died" not in proc.stderr


def test_a_store_that_is_a_file(model, tmp_path):
    (tmp_path / "file").write_text("a file where the store should be")
    proc, _ = start(tmp_path, "--model", str(model), "--store", str(tmp_path / "file"))
    assert proc.returncode == 1 and "--store" in proc.stderr and "is not a directory" in proc.stderr


def test_a_store_that_cannot_be_created_or_written(model, tmp_path):
    (tmp_path / "file").write_text("x")
    proc, _ = start(tmp_path, "--model", str(model), "--store", str(tmp_path / "file" / "store"))
    assert proc.returncode == 1 and "cannot create the store directory" in proc.stderr
    if os.geteuid() == 0:  # root writes through permission bits: a read-only file system is what stops it
        unwritable = "/proc/self"
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        unwritable = str(tmp_path / "ro")
    proc, _ = start(tmp_path, "--model", str(model), "--store", unwritable)
    assert proc.returncode == 1 and "is not writable" in proc.stderr, proc.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://host:notaport"])
def test_a_bad_remote_url(model, tmp_path, url):
    proc, _ = start(tmp_path, "--model", str(model), "--store", str(tmp_path / "s"), "--remote", url)
    assert proc.returncode == 1 and "cannot start: --remote" in proc.stderr, proc.stderr


def test_a_bad_warm_prompts_file(model, tmp_path):
    (tmp_path / "warm.jsonl").write_text('{"messages": [{"role": "user", "content": "hello"}]}\n{"nope": 1}\n')
    proc, _ = start(tmp_path, "--model", str(model), "--store", str(tmp_path / "s"), "--warm-prompts",
                    str(tmp_path / "warm.jsonl"))
    assert proc.returncode == 1 and "warm.jsonl line 2" in proc.stderr


def test_port_0_binds_a_free_port_and_says_which(model, tmp_path):
    """The one listening line names the port the system gave, and that port serves (the harness reads it)."""
    from serve_harness import Server

    with Server(model, tmp_path / "s", tmp_path / "a.log") as a, Server(model, tmp_path / "s", tmp_path / "b.log") as b:
        assert a.port and b.port and a.port != b.port
        for server in (a, b):
            lines = LISTENING_LINE.findall(server.log())
            assert lines == [str(server.port)], server.log()
            assert server._request("GET", "/health", None, timeout=30)[0] == 200
