"""``--pin-warm`` pins exactly the warm prompts' own sessions: not a user's conversation that starts with a warm
prompt (which the store's lookup may find first), and never again a warm session an operator unpinned (a restart
used to pin it back). Real server processes on 127.0.0.1 and the ``kvshelf unpin`` command."""

from __future__ import annotations

import http.client
import json

import pytest

from serve_harness import Server, conversation, kvshelf_cli
from tiny_model_dir import make_model_dir, words

SYSTEMS = [words(150, salt=1), words(150, salt=2)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def pins(server: Server) -> set[str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/kvshelf/stats")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return {p["session_id"] for p in doc["pins"]}


def test_only_the_warm_sessions_are_pinned_and_an_unpin_stays(model, tmp_path):
    store = tmp_path / "store"
    warm_file = tmp_path / "warm.jsonl"
    warm_file.write_text("".join(json.dumps({"messages": conversation(s, ["hello world"], [])}) + "\n"
                                 for s in SYSTEMS))
    extra = ("--warm-prompts", str(warm_file), "--pin-warm")
    with Server(model, store, tmp_path / "a.log", extra=extra) as server:
        server.wait_log(r"kvshelf warm done prompts=2 prefilled=2 from_store=0")
        warm_sessions = pins(server)
        assert len(warm_sessions) == 2
        # a user's conversation that starts with the first warm prompt, written behind as its own session
        first = server.chat(conversation(SYSTEMS[0], ["hello world"], []))
        longer = conversation(SYSTEMS[0], ["hello world", "and the disk of the store"], [first["text"]])
        reply = server.chat(longer)
        server.wait_log(rf"kvshelf write-behind saved tokens={reply['prompt_tokens'] + reply['completion_tokens']}\b")
        assert pins(server) == warm_sessions
    # the operator frees the second warm prompt's space
    second = sorted(warm_sessions)[0]
    done = kvshelf_cli("unpin", second, "--store", str(store))
    assert done.returncode == 0, done.stdout + done.stderr
    with Server(model, store, tmp_path / "b.log", extra=extra) as again:
        again.wait_log(r"kvshelf warm done prompts=2 prefilled=0 from_store=2")
        assert pins(again) == warm_sessions - {second}
        assert f"kvshelf warm: {second} was unpinned since --pin-warm pinned it; not pinned again" in again.log()
