"""What an operator of ``kvshelf serve`` sees: Prometheus metrics at ``/metrics`` (parsed with prometheus_client's
own parser), the ``X-Kvshelf-Prefix`` header on every completion, misses counted by reason, each server counting
its own requests, and a replayed conversation writing nothing. Real server processes on 127.0.0.1, the official
``openai`` client and http.client."""

from __future__ import annotations

import http.client
import json

import pytest

import openai
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import SAVED_LINE, Server, conversation
from store_cases import flip_chunk_byte
from tiny_model_dir import make_model_dir, words

from kvshelf import open_store

SYSTEM = words(200)
TURNS = ["hello world what is the cache", "and the disk of the store"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def metrics(server: Server) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    text = resp.read().decode()
    conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def client(server: Server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=300)


def chat(server: Server, messages: list[dict]) -> tuple[str, dict, int]:
    """One completion through the openai client: (text, the X-Kvshelf-Prefix fields, completion tokens)."""
    raw = client(server).chat.completions.with_raw_response.create(
        model="default_model", messages=messages, max_tokens=6, temperature=0.0)
    completion = raw.parse()
    header = raw.headers.get("x-kvshelf-prefix")
    assert header is not None, server.log()
    fields = dict(part.split("=") for part in header.split())
    assert set(fields) == {"source", "cached", "prompt"}
    assert int(fields["prompt"]) == completion.usage.prompt_tokens
    return completion.choices[0].message.content, fields, completion.usage.completion_tokens


def saved(server: Server, prompt: int, completion: int) -> None:
    server.wait_log(rf"kvshelf write-behind saved tokens={prompt + completion}\b")


def test_a_disk_hit_after_a_restart_is_in_the_metrics_and_the_header(model, tmp_path):
    store = tmp_path / "store"
    msgs = conversation(SYSTEM, TURNS[:1], [])
    with Server(model, store, tmp_path / "a.log") as first:
        text, head, n = chat(first, msgs)
        assert head["source"] == "none" and head["cached"] == "0"
        saved(first, int(head["prompt"]), n)
        m = metrics(first)
        assert m[("kvshelf_requests_total", (("source", "none"),))] == 1
        assert m[("kvshelf_misses_total", (("reason", "nothing_stored"),))] == 1
        assert m[("kvshelf_writes_total", (("outcome", "saved"),))] >= 1
        assert m[("kvshelf_bytes_written_total", ())] > 0
    with Server(model, store, tmp_path / "b.log") as again:
        msgs2 = conversation(SYSTEM, TURNS[:2], [text])
        _text, head, _n = chat(again, msgs2)
        assert head["source"] == "disk" and int(head["cached"]) > int(head["prompt"]) // 2
        line = again.prefix_lines()[-1]
        assert (line["source"], line["cached"], line["prompt"]) == ("disk", int(head["cached"]), int(head["prompt"]))
        m = metrics(again)
        assert m[("kvshelf_requests_total", (("source", "disk"),))] == 1
        assert m[("kvshelf_cached_tokens_total", (("tier", "disk"),))] == int(head["cached"])
        assert m[("kvshelf_prompt_tokens_total", ())] == int(head["prompt"])
        assert m[("kvshelf_restore_seconds_count", (("tier", "disk"),))] == 1
        assert m[("kvshelf_store_bytes", ())] > 0 and m[("kvshelf_write_queue_depth", ())] >= 0
        assert ("kvshelf_store_budget_bytes", ()) in m and ("kvshelf_pinned_bytes", ()) in m
        assert ("kvshelf_evictions_total", (("reason", "budget"), ("tier", "disk"))) in m and ("kvshelf_quarantined_total", ()) in m


def test_a_damaged_entry_is_a_miss_counted_by_its_reason(model, tmp_path):
    store = tmp_path / "store"
    msgs = conversation(SYSTEM, TURNS[:1], [])
    with Server(model, store, tmp_path / "a.log") as first:
        text, head, n = chat(first, msgs)
        saved(first, int(head["prompt"]), n)
    with open_store(store, admin=True) as admin:
        for h, _ in admin.admin.iter_chunks():
            flip_chunk_byte(admin, h)
    with Server(model, store, tmp_path / "b.log") as server:
        _t, head, _n = chat(server, conversation(SYSTEM, TURNS[:2], [text]))
        assert head["source"] == "none"
        m = metrics(server)
        assert m[("kvshelf_misses_total", (("reason", "damaged_entry"),))] == 1
        assert m[("kvshelf_quarantined_total", ())] >= 1
        assert any("reason=damaged_entry" in line for line in server.log().splitlines())


def test_two_servers_on_one_store_each_count_their_own(model, tmp_path):
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "a.log") as a, Server(model, store, tmp_path / "b.log") as b:
        msgs = conversation(SYSTEM, TURNS[:1], [])
        _t, head_a, n = chat(a, msgs)
        saved(a, int(head_a["prompt"]), n)
        chat(a, msgs)
        _t, head_b, _n = chat(b, msgs)
        assert head_b["source"] == "disk"
        ma, mb = metrics(a), metrics(b)
        assert (ma[("kvshelf_requests_total", (("source", "none"),))],
                ma[("kvshelf_requests_total", (("source", "ram"),))]) == (1, 1)
        assert (mb[("kvshelf_requests_total", (("source", "disk"),))],
                mb[("kvshelf_requests_total", (("source", "none"),))],
                mb[("kvshelf_requests_total", (("source", "ram"),))]) == (1, 0, 0)


def test_replaying_a_conversation_writes_nothing(model, tmp_path):
    store = tmp_path / "store"
    turns = conversation(SYSTEM, TURNS[:1], [])
    with Server(model, store, tmp_path / "a.log") as first:
        text, head, n = chat(first, turns)
        saved(first, int(head["prompt"]), n)
        turns2 = conversation(SYSTEM, TURNS[:2], [text])
        text2, head2, n2 = chat(first, turns2)
        saved(first, int(head2["prompt"]), n2)
    with Server(model, store, tmp_path / "b.log") as replay:
        before = len(SAVED_LINE.findall(replay.log()))
        assert chat(replay, turns)[0] == text and chat(replay, turns2)[0] == text2
        replay.signal(2)  # SIGINT: flush what is pending, then exit; the log then holds every write's outcome
        assert replay.wait() == 0
        log = replay.log()
        assert len(SAVED_LINE.findall(log)) == before == 0, log
        assert "kvshelf write-behind skipped: the store holds these" in log
        info = [line for line in log.splitlines() if " - INFO - kvshelf " in line]
        assert sum("kvshelf prefix" in line for line in info) == 2
        assert not any("write-behind saved" in line or "write-behind queued" in line for line in info)
        assert "0 saved" in log
