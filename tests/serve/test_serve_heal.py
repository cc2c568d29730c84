"""A damaged chunk harms a conversation once, not forever (real ``kvshelf serve``, real model classes): the first
request after one byte of a chunk is flipped quarantines the snapshot and answers from a prefill; the write-behind
right after it writes fresh bytes for the damaged chunk instead of deduplicating onto it; after a restart the same
conversation is a disk hit again; and ``verify --deep`` is clean once ``repair`` has dropped the evidence."""

from __future__ import annotations

import json
import re

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


def test_after_a_flipped_chunk_the_next_write_behind_heals_and_a_restart_hits_disk_again(model, tmp_path):
    store = tmp_path / "store"
    msgs1 = conversation(SYSTEM, TURNS[:1], [])
    with Server(model, store, tmp_path / "first.log") as first:
        r1 = first.chat(msgs1)
        first.wait_log(rf"kvshelf write-behind saved tokens={final_tokens(r1)}\b")
    with open_store(store, identity=model_identity(model)) as lib:  # another session holding the same content
        # the conversation's own snapshot (mlx-lm's segment inserts, system prompt and user turn, are there too)
        info = max(lib.sessions(), key=lambda s: s.length)
        held = lib.restore(info.session_id, namespace=info.namespace)
        lib.save("kept-copy", held.tokens, held.caches, namespace=info.namespace)
    with open_store(store, admin=True) as admin:
        bad = admin.admin.manifest(info.snapshot_id).chunks[0].hash  # shared by both sessions
        assert admin.admin.chunk_info(bad).refs >= 2
        damaged_pack = admin.admin.chunk_location(bad)[0]
        flip_chunk_byte(admin, bad)
    with Server(model, store, tmp_path / "second.log") as second:  # the same conversation again
        again = second.chat(msgs1)
        assert again["text"] == r1["text"]  # answered correctly from a prefill
        second.wait_log(r"kvshelf disk prefix failed, serving from RAM: CorruptData")
        # the conversation's last write-behind: saved, or skipped when an earlier segment's save (cut where the
        # stored snapshot was cut: the same chunks) already wrote the damaged chunk afresh
        n = final_tokens(again)
        second.wait_log(rf"kvshelf write-behind (saved tokens={n} new_bytes=\d+|skipped: the store holds these {n} "
                        rf"tokens)")
        written = [int(n) for n in re.findall(r"kvshelf write-behind saved tokens=\d+ new_bytes=(\d+)", second.log())]
        assert sum(written) > 0  # the same content, yet the damaged chunk is written afresh, not reused
    with open_store(store, admin=True) as admin:
        now = admin.admin.chunk_location(bad)
        assert now is not None and now[0] != damaged_pack  # fresh bytes took the chunk's name back
        assert admin.admin.bad_chunks() == []  # and the copy kept by the other session is healed by the same write
    msgs2 = conversation(SYSTEM, TURNS[:2], [r1["text"]])
    with Server(model, store, tmp_path / "third.log") as third:  # a restart
        third.chat(msgs2)
        assert third.prefix_lines()[-1]["source"] == "disk"  # the conversation is a disk hit again
        assert "CorruptData" not in third.log()
    healed = kvshelf_cli("verify", "--deep", "--store", str(store), "--json")  # before any repair: what the server
    assert healed.returncode == 0, healed.stdout + healed.stderr          # healed needs no operator (a cron stays
    found = json.loads(healed.stdout)                                      # quiet), and is still listed
    assert found["needs_operator"] == 0 and found["handled"] >= 1
    assert {p["kind"] for p in found["problems"]} <= {"orphan-object", "quarantined"}
    repair = kvshelf_cli("repair", "--store", str(store), "--json")
    assert repair.returncode == 0, repair.stdout + repair.stderr
    assert json.loads(repair.stdout)["lost"] == []  # the write healed everything: nothing had to be dropped
    verify = kvshelf_cli("verify", "--deep", "--store", str(store), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
