"""Sessions as files over HTTP: real ``kvshelf serve`` processes on 127.0.0.1, the official ``openai`` client for the
turns, ``http.client`` for ``/kvshelf/sessions``, real stores on disk and ``kvshelf gc`` / ``kvshelf delete`` run
as the operator runs them.

What is proved: a session exported, the store wiped, the file imported into a fresh server makes the next turn a
disk hit; a fork writes (almost) nothing new; a file of another model or a damaged one is refused with a 4xx and
writes nothing; delete + gc frees the session's bytes; a tenant never sees another tenant's sessions; odd ids.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import quote

import openai
import pytest

from serve_harness import Server, conversation, kvshelf_cli
from tiny_model_dir import make_model_dir, words

SYSTEM = words(700)
KEYS = {"key-alice-0123456789": "alice", "key-bob-9876543210": "bob"}
ADMIN = "admin-secret-token-42"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def call(server: Server, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def ask(server: Server, messages: list[dict], key: str = "none") -> dict:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(model="default_model", messages=messages, max_tokens=6,
                                                           temperature=0.0)
    doc = raw.parse()
    header = dict(kv.split("=", 1) for kv in raw.headers.get("X-Kvshelf-Prefix", "").split())
    return {"text": doc.choices[0].message.content, "header": header, "prompt": doc.usage.prompt_tokens,
            "completion": doc.usage.completion_tokens}


def settled(server: Server, answer: dict) -> None:
    """Every write-behind of the request is done: the whole turn's cache (prompt + reply) saved, and as many
    writes finished as were queued (mlx-lm inserts a request's caches more than once)."""
    server.wait_log(rf"kvshelf write-behind saved tokens={answer['prompt'] + answer['completion']}\b")
    server.wait_log(r"kvshelf write-behind (saved|failed)",
                    count=len(re.findall(r"kvshelf write-behind queued", server.log())))


def sessions(server: Server, headers: dict | None = None) -> list[dict]:
    status, body = call(server, "GET", "/kvshelf/sessions", headers=headers)
    assert status == 200, body
    return json.loads(body)["sessions"]


def longest(server: Server, headers: dict | None = None) -> dict:
    return max(sessions(server, headers), key=lambda s: s["tokens"])


def pack_bytes(store: Path) -> int:
    """Bytes of every object file the store holds (packs and chunk files; not the index)."""
    total = 0
    for root, _dirs, files in os.walk(store):
        if Path(root).relative_to(store).parts[:1] in (("index",), ("leases",), ("locks",)):
            continue
        total += sum((Path(root) / f).stat().st_size for f in files)
    return total


def turn_one(server: Server) -> tuple[list[dict], str]:
    msgs = conversation(SYSTEM, ["hello"], [])
    first = ask(server, msgs)
    settled(server, first)
    return msgs, first["text"]


def test_export_wipe_import_and_the_next_turn_hits(model, tmp_path):
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "a.log") as a:
        msgs, reply = turn_one(a)
        session = longest(a)
        status, file = call(a, "POST", f"/kvshelf/sessions/{quote(session['session_id'], safe='')}/export")
        assert status == 200 and file[8:9] == b"{" and len(file) > session["bytes"] // 2
    shutil.rmtree(store)  # the store is gone: only the file is left
    nxt = conversation(SYSTEM, ["hello", "tell me more"], [reply])
    with Server(model, None, tmp_path / "cold.log") as cold:
        cold_text = ask(cold, nxt)["text"]
    with Server(model, store, tmp_path / "b.log") as b:
        assert sessions(b) == []
        status, body = call(b, "POST", "/kvshelf/sessions/import", file)
        assert status == 201, body
        done = json.loads(body)
        assert done["session_id"] == session["session_id"] and done["tokens"] == session["tokens"]
        hit = ask(b, nxt)
        assert hit["header"]["source"] == "disk" and int(hit["header"]["cached"]) >= len(SYSTEM.split())
        assert hit["text"] == cold_text  # restored, not merely found
        status, body = call(b, "POST", "/kvshelf/sessions/import", file)  # importing again: replaced, still fine
        assert status == 201, body


def test_fork_shares_every_chunk_and_delete_frees_after_gc(model, tmp_path):
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "s.log") as server:
        turn_one(server)
        session = longest(server)
        before = pack_bytes(store)
        sid = quote(session["session_id"], safe="")
        status, body = call(server, "POST", f"/kvshelf/sessions/{sid}/fork?to={quote('team/branch 1', safe='')}")
        assert status == 201, body
        grown = pack_bytes(store) - before
        assert grown < 0.05 * session["bytes"], (grown, session["bytes"])
        listed = {s["session_id"]: s for s in sessions(server)}
        assert listed["team/branch 1"]["tokens"] == session["tokens"]
        assert call(server, "POST", f"/kvshelf/sessions/{sid}/fork?to={quote('team/branch 1', safe='')}")[0] == 409
        status, file = call(server, "POST", f"/kvshelf/sessions/{quote('team/branch 1', safe='')}/export")
        assert status == 200  # the slash travels percent-encoded and names the session

        full = pack_bytes(store)
        for s in sessions(server):
            status, body = call(server, "DELETE", f"/kvshelf/sessions/{quote(s['session_id'], safe='')}")
            assert status == 200, body
        assert sessions(server) == []
        assert call(server, "DELETE", f"/kvshelf/sessions/{sid}")[0] == 404  # gone
        gc = kvshelf_cli("gc", "--store", str(store), "--json")
        assert gc.returncode == 0, gc.stderr
        assert pack_bytes(store) < 0.05 * full, (pack_bytes(store), full)


def test_another_model_or_a_damaged_file_is_refused(model, tmp_path):
    other = make_model_dir(tmp_path / "other", "llama", seed=1)
    with Server(other, tmp_path / "other-store", tmp_path / "o.log") as o:
        turn_one(o)
        status, foreign = call(o, "POST", f"/kvshelf/sessions/{quote(longest(o)['session_id'], safe='')}/export")
        assert status == 200
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "s.log") as server:
        turn_one(server)
        status, good = call(server, "POST",
                            f"/kvshelf/sessions/{quote(longest(server)['session_id'], safe='')}/export")
        assert status == 200
        ids = {s["session_id"] for s in sessions(server)}
        status, body = call(server, "POST", "/kvshelf/sessions/import?session=foreign", foreign)
        assert status == 409 and b"IdentityMismatch" in body, body
        flipped = bytearray(good)
        flipped[len(good) - 1000] ^= 0x40  # one bit inside the last tensor
        for name, bad in (("flipped", bytes(flipped)), ("truncated", good[: len(good) // 2]),
                          ("not-a-snapshot", b"hello, this is not a safetensors file at all")):
            status, body = call(server, "POST", f"/kvshelf/sessions/import?session={name}", bad)
            assert status == 422, (name, status, body)
        assert {s["session_id"] for s in sessions(server)} == ids  # nothing refused was written
        assert server.proc.poll() is None


def test_tenants_the_admin_gate_and_odd_ids(model, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    alice, bob = list(KEYS)
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "s.log", extra=("--api-keys", str(keys), "--admin-token", ADMIN)) as server:
        settled(server, ask(server, conversation(SYSTEM, ["hello"], []), key=alice))
        as_alice = {"Authorization": f"Bearer {ADMIN}", "x-api-key": alice}
        as_bob = {"Authorization": f"Bearer {ADMIN}", "x-api-key": bob}
        assert call(server, "GET", "/kvshelf/sessions")[0] == 401  # no admin token
        assert call(server, "GET", "/kvshelf/sessions", headers={"x-api-key": alice})[0] == 401
        assert call(server, "GET", "/kvshelf/sessions", headers={"Authorization": f"Bearer {ADMIN}"})[0] == 401
        mine = longest(server, as_alice)
        sid = quote(mine["session_id"], safe="")
        assert sessions(server, as_bob) == []  # bob sees none of alice's
        status, body = call(server, "GET", "/kvshelf/sessions?cache_salt=team-1", headers=as_alice)
        assert status == 200 and json.loads(body)["sessions"] == []  # a salted scope is another scope
        assert call(server, "POST", f"/kvshelf/sessions/{sid}/export", headers=as_bob)[0] == 404
        assert call(server, "DELETE", f"/kvshelf/sessions/{sid}", headers=as_bob)[0] == 404
        assert call(server, "POST", f"/kvshelf/sessions/{sid}/fork?to=x", headers=as_bob)[0] == 404
        status, file = call(server, "POST", f"/kvshelf/sessions/{sid}/export", headers=as_alice)
        assert status == 200
        status, body = call(server, "POST", "/kvshelf/sessions/import?session=copy", file, headers=as_bob)
        assert status == 201  # a file is filed under the importer's tenant, whatever namespace it names
        assert [s["session_id"] for s in sessions(server, as_bob)] == ["copy"]
        assert "copy" not in {s["session_id"] for s in sessions(server, as_alice)}
        for bad in ("%FF%FE", "%00", "a%0Ab", "x" * 500):
            assert call(server, "POST", f"/kvshelf/sessions/{bad}/export", headers=as_alice)[0] == 400, bad
        assert call(server, "POST", "/kvshelf/sessions/no-such/export", headers=as_alice)[0] == 404
        assert call(server, "POST", f"/kvshelf/sessions/{sid}/fork", headers=as_alice)[0] == 400  # no ?to=
        assert call(server, "POST", f"/kvshelf/sessions/{sid}/rename", headers=as_alice)[0] == 404
        log = server.log()
        assert ADMIN not in log and alice not in log and bob not in log


def test_kvshelf_delete_offline(model, tmp_path):
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "s.log") as server:
        turn_one(server)
        names = [s["session_id"] for s in sessions(server)]
    gone = kvshelf_cli("delete", names[0], "--store", str(store), "--json")
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["session_id"] == names[0]
    ls = kvshelf_cli("ls", "--store", str(store), "--json")
    assert names[0] not in ls.stdout
    again = kvshelf_cli("delete", names[0], "--store", str(store))
    assert again.returncode == 1 and "SnapshotNotFound" in again.stderr
