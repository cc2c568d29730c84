"""Warm-up and pins as an operator uses them: ``kvshelf serve --warm-prompts FILE --pin-warm`` prefills before it
listens, so the first request of a warmed conversation is a store hit (tokens counted, not timed); a second start
prefills nothing; pinned prompts outlive a budget that evicts the traffic around them; ``kvshelf warm`` does the
same offline; ``kvshelf pin`` / ``unpin`` / ``ls`` / ``stats`` show and change pins; a pin beyond
``--max-pinned-bytes`` is refused with a clear message."""

from __future__ import annotations

import json
import re

import pytest

from serve_harness import Server, conversation, kvshelf_cli
from tiny_model_dir import make_model_dir, words

WARM = re.compile(r"kvshelf warm done prompts=(\d+) prefilled=(\d+) from_store=(\d+)")
SYSTEMS = [words(200, salt=1), words(180, salt=2)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


@pytest.fixture()
def warm_file(tmp_path):
    path = tmp_path / "warm.jsonl"
    lines = [{"messages": conversation(s, ["hello world"], [])} for s in SYSTEMS]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n# a comment line\n")
    return path


def warm_counts(server: Server) -> tuple[int, int, int]:
    m = server.wait_log(WARM)[-1]
    return int(m[1]), int(m[2]), int(m[3])


def test_warm_prompts_make_the_first_request_a_hit_and_a_restart_prefills_nothing(model, tmp_path, warm_file):
    store = tmp_path / "store"
    with Server(model, None, tmp_path / "cold.log") as cold:
        want = cold.chat(conversation(SYSTEMS[0], ["hello world"], []))
    with Server(model, store, tmp_path / "a.log", extra=("--warm-prompts", str(warm_file))) as warmed:
        assert warm_counts(warmed) == (2, 2, 0)
        got = warmed.chat(conversation(SYSTEMS[0], ["hello world"], []))
        line = warmed.prefix_lines()[0]
        assert line["source"] == "disk" and line["cached"] == got["prompt_tokens"] - 1 == got["cached_tokens"]
        assert got["text"] == want["text"] and want["cached_tokens"] == 0
    with Server(model, store, tmp_path / "b.log", extra=("--warm-prompts", str(warm_file))) as again:
        assert warm_counts(again) == (2, 0, 2)


def test_pinned_warm_prompts_outlive_a_budget_that_evicts_the_traffic(model, tmp_path, warm_file):
    store = tmp_path / "store"
    extra = ("--warm-prompts", str(warm_file), "--pin-warm", "--max-bytes", "600K")
    with Server(model, store, tmp_path / "a.log", extra=extra) as server:
        assert warm_counts(server) == (2, 2, 0)
        for salt in range(3, 9):  # other conversations: ~100 KiB per write-behind, past the 600 KiB budget
            server.chat(conversation(words(200, salt=salt), ["what is the cache"], []), max_tokens=2)
        server.signal(2)
        assert server.wait() == 0
        assert re.search(r"write-behind flushed: [1-9]\d* saved", server.log())
    listing = json.loads(kvshelf_cli("ls", "--store", str(store), "--json").stdout)
    rows = listing if isinstance(listing, list) else listing.get("sessions", listing)
    pinned = [r for r in rows if r["pinned"]]
    assert len(pinned) == 2 and all(r["pin_expires_at"] is None for r in pinned)
    stats = json.loads(kvshelf_cli("stats", "--store", str(store), "--json").stdout)
    assert stats["pinned_bytes"] == sum(r["bytes_own"] + r["bytes_shared"] for r in pinned) > 0
    assert stats["stored_bytes"] <= 600 * 1024
    assert len(rows) < 2 + 6 * 2  # the traffic was evicted around the pins


def test_offline_warm_then_pin_unpin_and_a_pin_beyond_the_limit(model, tmp_path, warm_file):
    store = tmp_path / "store"
    done = kvshelf_cli("warm", "--model", str(model), "--store", str(store), str(warm_file), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["prompts"], doc["prefilled"], doc["from_store"]) == (2, 2, 0)
    first, second = doc["sessions"]
    pinned = kvshelf_cli("pin", first, "--ttl", "7d", "--store", str(store))
    assert pinned.returncode == 0 and "pinned" in pinned.stdout
    refused = kvshelf_cli("pin", second, "--max-pinned-bytes", "150000", "--store", str(store))
    assert refused.returncode == 1 and "over the pin limit of 150000 bytes" in refused.stderr
    rows = json.loads(kvshelf_cli("ls", "--store", str(store), "--json").stdout)
    rows = rows if isinstance(rows, list) else rows.get("sessions", rows)
    by_id = {r["session_id"]: r for r in rows}
    assert by_id[first]["pinned"] and by_id[first]["pin_expires_at"] is not None and not by_id[second]["pinned"]
    assert kvshelf_cli("unpin", first, "--store", str(store)).returncode == 0
    assert kvshelf_cli("unpin", first, "--store", str(store)).returncode == 1  # not pinned any more: said so
    with Server(model, store, tmp_path / "s.log", extra=("--warm-prompts", str(warm_file), "--pin-warm",
                                                         "--max-pinned-bytes", "150000")) as server:
        assert warm_counts(server) == (2, 0, 2)
        server.wait_log(r"kvshelf warm: pin of prompt-\d+-\w+ refused: .*over the pin limit of 150000 bytes")
        server.chat(conversation(SYSTEMS[1], ["hello world"], []))
        assert server.prefix_lines()[0]["source"] == "disk"
