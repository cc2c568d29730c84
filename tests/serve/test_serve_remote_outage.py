"""A shared-tier outage an operator can see: redis-server killed mid-run and started again. The server logs one
WARNING when the outage starts and one when it ends, ``kvshelf_remote_errors_total{op}`` rises, and every request
is served throughout. Real server processes and a real redis-server on 127.0.0.1."""

from __future__ import annotations

import http.client
import time

import pytest

from prometheus_client.parser import text_string_to_metric_families
from redis_servers import RedisServer
from serve_harness import Server
from tiny_model_dir import WORDS, make_model_dir, words

DOWN = "kvshelf shared tier redis://127.0.0.1:{port}/0 unreachable"
UP = "kvshelf shared tier redis://127.0.0.1:{port}/0 reachable again"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def errors(server: Server) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {s.labels["op"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kvshelf_remote_errors_total"}


def until_logged(server: Server, line: str, first: int, limit: int = 400) -> int:
    """Send new prompts (each one asks the shared tier) until ``line`` is in the log; returns the next prompt's
    number. Every request must be served."""
    i = first
    while line not in server.log():
        assert i - first < limit, server.log()
        reply = server.chat([{"role": "user", "content": f"{WORDS[i % 128]} {WORDS[i // 128]} " + words(40, i)}],
                            max_tokens=1)
        assert reply["completion_tokens"] == 1
        i += 1
        if i - first > 5:
            time.sleep(0.1)  # past the breaker's first backoff: its probe is what the next request sends
    return i


def test_a_remote_outage_logs_once_each_way_and_is_counted(model, tmp_path):
    remote = RedisServer()
    try:
        extra = ("--remote", remote.url, "--remote-option", "socket_timeout=1")
        with Server(model, tmp_path / "store", tmp_path / "a.log", extra=extra) as server:
            down, up = DOWN.format(port=remote.port), UP.format(port=remote.port)
            i = until_logged(server, "kvshelf prefix", 0)  # one request with the tier up
            assert errors(server) == {"lookup": 0, "restore": 0, "publish": 0}
            remote.kill()
            i = until_logged(server, down, i)
            during = errors(server)
            assert during["lookup"] + during["publish"] >= 1
            remote.start()  # the same port
            i = until_logged(server, up, i)
            assert server.chat([{"role": "user", "content": words(40, i)}], max_tokens=1)["completion_tokens"] == 1
            log = server.log()
            assert server.proc.poll() is None
    finally:
        remote.close()
    assert log.count(down) == 1 and log.count(up) == 1, log
    assert all(" - WARNING - " in line for line in log.splitlines() if down in line or up in line), log
    assert "Traceback" not in log
