"""``kvshelf serve`` as users run it: real server processes on 127.0.0.1, a real HTTP client, a tiny model directory.

A conversation with a long system prompt at temperature 0 must read the same whether the server kept running
(plain ``mlx_lm.server``, RAM only: the reference), was SIGKILLed and restarted on its store, or is another server
process on the same store; and the log must say the prefix came from disk, with the length the never-restarted
server reused from RAM. Another model's server on the same store never receives these caches.
"""

from __future__ import annotations

import pytest

from serve_harness import SAVED_LINE, Server, conversation
from tiny_model_dir import make_model_dir, words

from kvshelf import open_store
from kvshelf.mlx_lm import model_identity

SYSTEM = words(200)
TURNS = ["hello world what is the cache", "and the disk of the store", "one more short question"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_model_dir(root / "llama-a", "llama", seed=0), make_model_dir(root / "llama-b", "llama", seed=1)


def wait_saved(server: Server, reply: dict) -> None:
    """Block until the write-behind of the turn's final cache (prompt + reply tokens) is durable."""
    server.wait_log(rf"kvshelf write-behind saved tokens={reply['prompt_tokens'] + reply['completion_tokens']}\b")


def test_restart_and_a_second_server_continue_from_disk(models, tmp_path):
    model, _ = models
    store = tmp_path / "store"
    with Server(model, None, tmp_path / "ref.log") as ref:
        first = Server(model, store, tmp_path / "first.log")
        try:
            msgs1 = conversation(SYSTEM, TURNS[:1], [])
            r1 = first.chat(msgs1)
            assert r1["text"] == ref.chat(msgs1)["text"]
            wait_saved(first, r1)
        finally:
            first.kill()  # SIGKILL after the write-behind completed

        with Server(model, store, tmp_path / "restarted.log") as restarted, \
                Server(model, store, tmp_path / "second.log") as second:
            msgs2 = conversation(SYSTEM, TURNS[:2], [r1["text"]])
            want2 = ref.chat(msgs2)
            r2 = restarted.chat(msgs2)
            assert r2["text"] == want2["text"]
            line = restarted.prefix_lines()[-1]
            assert line["source"] == "disk" and line["cached"] == want2["cached_tokens"] == r2["cached_tokens"]
            assert line["cached"] > r1["prompt_tokens"]  # the whole first turn, reply included, came from disk

            wait_saved(restarted, r2)  # now the second server, alive all along, gets turn two from disk
            msgs3 = conversation(SYSTEM, TURNS[:3], [r1["text"], r2["text"]])
            want3 = ref.chat(msgs3)
            r3 = second.chat(msgs3)
            assert r3["text"] == want3["text"]
            line = second.prefix_lines()[-1]
            assert line["source"] == "disk" and line["cached"] == want3["cached_tokens"] > r2["prompt_tokens"]


def test_another_model_on_the_same_store_never_gets_its_caches(models, tmp_path):
    model_a, model_b = models  # same tokenizer and shapes, other weights
    store = tmp_path / "store"
    msgs1 = conversation(SYSTEM, TURNS[:1], [])
    with Server(model_a, store, tmp_path / "a.log") as a:
        ra = a.chat(msgs1)
        wait_saved(a, ra)
    with Server(model_b, None, tmp_path / "ref-b.log") as ref_b, Server(model_b, store, tmp_path / "b.log") as b:
        rb1, want1 = b.chat(msgs1), ref_b.chat(msgs1)
        assert rb1["text"] == want1["text"] and rb1["cached_tokens"] == 0
        msgs2 = conversation(SYSTEM, TURNS[:2], [rb1["text"]])
        assert b.chat(msgs2)["text"] == ref_b.chat(msgs2)["text"]
        assert [p["source"] for p in b.prefix_lines()] == ["none", "ram"]
    with open_store(store, admin=True) as admin:  # model A's caches were there, token for token, all along
        a_key = model_identity(model_a).key
        stored = {s.length for s in admin.admin.summaries().values() if s.id_key == a_key}
    # the whole turn is stored; the prompt-only insert may be skipped as a duplicate of it (a prefix the store holds)
    assert ra["prompt_tokens"] + ra["completion_tokens"] in stored


def test_every_write_behind_of_a_turn_is_logged_and_counted(models, tmp_path):
    model, _ = models
    with Server(model, tmp_path / "store", tmp_path / "s.log", extra=("--max-bytes", "64M")) as server:
        assert "budget 67108864)" in server.log()
        r = server.chat(conversation(SYSTEM, TURNS[:1], []))
        wait_saved(server, r)
        queued = server.wait_log(r"kvshelf write-behind queued tokens=(\d+)")
        saved = server.wait_log(SAVED_LINE, count=len(queued))
        assert sorted(int(m[1]) for m in queued) == sorted(int(m["tokens"]) for m in saved)
        assert "write-behind failed" not in server.log()
