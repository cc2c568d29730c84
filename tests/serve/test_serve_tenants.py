"""Tenants never see each other's prompts: real ``kvshelf serve`` processes on 127.0.0.1, the official ``openai``
client, a real redis-server.

The probe (published attacks on shared prefix caches): tenant A sends a long system prompt; tenant B sends the same
prompt and then prefixes of it. Every answer B gets must say nothing was cached (``cached_tokens``, the
``X-Kvshelf-Prefix`` header, the server's own log line) and equal a cold server's, in RAM, after a restart (disk)
and on a second server through the shared tier; A's repeat hits; A with one salt hits, with another salt misses.
Then the doors: API keys (401/403), the admin token on ``/metrics``, hostile salts and headers (400, server alive,
nothing written).
"""

from __future__ import annotations

import json
import socket

import openai
import pytest

from redis_servers import RedisServer
from serve_harness import Server, conversation
from tiny_model_dir import make_model_dir, words

SYSTEM = words(2000)
KEYS = {"key-alice-0123456789": "alice", "key-bob-9876543210": "bob"}
ADMIN = "admin-secret-token-42"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


@pytest.fixture()
def keys_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for k, t in KEYS.items()))
    return path


def client(server: Server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0, timeout=300)


def ask(server: Server, key: str, messages: list[dict], salt: str | None = None) -> dict:
    """One greedy completion through the openai client: its text, cached tokens and X-Kvshelf-Prefix fields."""
    raw = client(server, key).chat.completions.with_raw_response.create(
        model="default_model", messages=messages, max_tokens=4, temperature=0.0,
        extra_body={"cache_salt": salt} if salt is not None else None)
    doc = raw.parse()
    details = doc.usage.prompt_tokens_details
    header = dict(kv.split("=", 1) for kv in raw.headers.get("X-Kvshelf-Prefix", "").split())
    return {"text": doc.choices[0].message.content, "cached": (details.cached_tokens if details else 0) or 0,
            "header": header, "prompt": doc.usage.prompt_tokens}


def saved(server: Server, count: int) -> None:
    server.wait_log(r"kvshelf write-behind saved tokens=\d+", count=count)


def probe(server: Server, b_key: str, cold_text: str, phase: str) -> None:
    """B's view of A's prompt: nothing cached, ever, and the cold reply. Each probe is a fresh salt of B's (what B
    itself sent before is B's to reuse: the probe asks only what A's requests could have left)."""
    before = len(server.prefix_lines())
    b = ask(server, b_key, conversation(SYSTEM, ["hello"], []), salt=f"{phase}-full")
    assert b["cached"] == 0 and b["header"]["cached"] == "0" and b["text"] == cold_text
    for n, cut in enumerate((1500, 600, 40)):  # prefixes of A's system prompt
        p = ask(server, b_key, conversation(" ".join(SYSTEM.split()[:cut]), ["hello"], []), salt=f"{phase}-{n}")
        assert p["cached"] == 0 and p["header"]["cached"] == "0"
    lines = server.prefix_lines()[before:]
    assert [line["source"] for line in lines] == ["none"] * 4 and all(line["cached"] == 0 for line in lines)


def test_another_tenant_never_hits_ram_disk_or_the_shared_tier(model, keys_file, tmp_path):
    alice, bob = list(KEYS)
    msgs = conversation(SYSTEM, ["hello"], [])
    remote = RedisServer()
    extra = ("--api-keys", str(keys_file), "--remote", remote.url, "--remote-prefix", "tenants:")
    try:
        with Server(model, None, tmp_path / "cold.log") as cold:
            cold_text = ask(cold, "none", msgs)["text"]

        first = Server(model, tmp_path / "store", tmp_path / "first.log", extra=extra)
        try:  # RAM: A's prompt is in the RAM tier (and being written behind)
            a1 = ask(first, alice, msgs)
            assert a1["cached"] == 0 and a1["text"] == cold_text
            saved(first, 1)  # A's prompt is on disk and in the shared tier before B probes
            probe(first, bob, cold_text, "ram")
            again = ask(first, alice, msgs)
            assert again["header"]["source"] == "ram" and again["cached"] > 1900
            same = ask(first, alice, msgs, salt="team-1")
            assert same["cached"] == 0  # a salt is another scope than no salt
            assert ask(first, alice, msgs, salt="team-1")["cached"] > 1900  # the same salt reuses
            assert ask(first, alice, msgs, salt="team-2")["cached"] == 0  # another salt never
            saved(first, 2)
        finally:
            first.kill()

        with Server(model, tmp_path / "store", tmp_path / "restarted.log", extra=extra) as restarted:  # disk
            probe(restarted, bob, cold_text, "disk")
            hit = ask(restarted, alice, msgs)
            assert hit["header"]["source"] == "disk" and hit["cached"] > 1900 and hit["text"] == cold_text

        with Server(model, tmp_path / "store-2", tmp_path / "second.log", extra=extra) as second:  # shared tier
            probe(second, bob, cold_text, "remote")
            hit = ask(second, alice, msgs)
            assert hit["header"]["source"] == "remote" and hit["cached"] > 1900 and hit["text"] == cold_text
    finally:
        remote.close()


def test_keys_and_the_admin_token(model, keys_file, tmp_path):
    alice, _bob = list(KEYS)
    extra = ("--api-keys", str(keys_file), "--admin-token", ADMIN)
    msgs = conversation("short system", ["hi"], [])
    with Server(model, tmp_path / "store", tmp_path / "s.log", extra=extra) as server:
        with pytest.raises(openai.AuthenticationError):
            ask(server, "not-a-key", msgs)
        status, body = server._request("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
        assert status == 401 and b"required" in body  # no key at all
        assert ask(server, alice, msgs)["text"]  # a key maps to its tenant and is served
        with pytest.raises(openai.PermissionDeniedError):  # a header never widens what the key may see
            client(server, alice).chat.completions.create(
                model="default_model", messages=msgs, max_tokens=2, extra_headers={"X-Kvshelf-Tenant": "bob"})
        for path in ("/metrics", "/kvshelf", "/kvshelf/stats"):
            assert server._request("GET", path, None)[0] == 401
            assert get(server, path, {"Authorization": "Bearer wrong"})[0] == 401
            assert get(server, path, {"Authorization": f"Bearer {ADMIN}"})[0] == 200
        log = server.log()
        assert ADMIN not in log and alice not in log  # secrets never reach the log


def get(server: Server, path: str, headers: dict) -> tuple[int, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def raw_post(server: Server, headers: bytes, body: dict) -> tuple[int, bytes]:
    """A POST written byte by byte (headers http.client would refuse to send: non-UTF-8, NUL)."""
    payload = json.dumps(body).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               + headers + b"Content-Length: " + str(len(payload)).encode() + b"\r\nConnection: close\r\n\r\n"
               + payload)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[-1]


@pytest.mark.parametrize("case", [
    ("salt", "x" * 10_000), ("salt", "a\x00b"), ("salt", "a\nb"), ("salt", ""), ("salt", 7),
    ("header", b"x" * 10_000), ("header", b"a\x00b"), ("header", b"\xff\xfe\xc3"), ("header", b"a\x1bb"),
], ids=["salt-10KB", "salt-NUL", "salt-newline", "salt-empty", "salt-int", "header-10KB", "header-NUL",
        "header-not-utf8", "header-escape"])
def test_hostile_salts_and_headers_get_400_and_write_nothing(model, tmp_path, case):
    kind, value = case
    msgs = conversation(words(40), ["hi"], [])
    with Server(model, tmp_path / "store", tmp_path / "s.log") as server:
        body = {"messages": msgs, "max_tokens": 2, "temperature": 0.0}
        if kind == "salt":
            status, answer = raw_post(server, b"", {**body, "cache_salt": value})
        else:
            status, answer = raw_post(server, b"X-Kvshelf-Tenant: " + value + b"\r\n", body)
        assert status == 400, answer
        assert b"cache_salt" in answer or b"X-Kvshelf-Tenant" in answer
        assert server.proc.poll() is None
        assert server.prefix_lines() == [] and "write-behind" not in server.log()  # nothing fetched or written
        ok, _ = raw_post(server, b"", body)  # and the server still serves
        assert ok == 200


def test_an_encrypted_store_with_tenant_quotas_through_serve(model, keys_file, tmp_path):
    """--encryption-key-file and --tenant-max-bytes reach the store: a restart with the key serves from disk, a
    wrong key refuses to start (naming the store, never the key), and one tenant's flood evicts only its own."""
    from serve_harness import kvshelf_cli

    alice, bob = list(KEYS)
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    store = tmp_path / "store"
    extra = ("--api-keys", str(keys_file), "--encryption-key-file", str(key), "--tenant-max-bytes", "600K")
    bob_msgs = conversation(words(300, salt=5), ["hello"], [])
    with Server(model, store, tmp_path / "a.log", extra=extra) as server:
        first = ask(server, bob, bob_msgs)
        saved(server, 1)
        for i in range(8):  # alice floods far past her quota
            ask(server, alice, conversation(words(400, salt=100 + i), ["hi"], []))
        saved(server, 9)
    # killed with alice's last write-behinds maybe in flight (between a save's commit and its eviction): the
    # restart's open evicts her back under her quota (space/budget.py, enforce_tenants)
    with Server(model, store, tmp_path / "b.log", extra=extra) as restarted:
        again = ask(restarted, bob, bob_msgs)
        assert again["header"]["source"] == "disk" and again["text"] == first["text"]
    listed = kvshelf_cli("ls", "--store", str(store), "--tenant", "alice", "--json",
                         "--encryption-key-file", str(key))
    assert listed.returncode == 0, listed.stderr
    alice_sessions = json.loads(listed.stdout)["sessions"]
    assert 0 < len(alice_sessions) < 8  # her flood evicted her own sessions (bob's was served from disk above)
    assert sum(x["bytes_own"] + x["bytes_shared"] for x in alice_sessions) <= 600 << 10
    wrong = tmp_path / "wrong"
    wrong.write_bytes(bytes(range(1, 33)))
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", "serve", "--store", str(store), "--model",
                           str(model), "--port", "0", "--encryption-key-file", str(wrong)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "cannot start" in proc.stderr and str(store) in proc.stderr
    assert bytes(range(1, 33)).hex() not in proc.stderr + proc.stdout
