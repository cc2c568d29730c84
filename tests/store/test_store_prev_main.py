"""A store written by the previous main (before issue 28 moved every module of the store) opens, restores bit-exact
and verifies clean: the restructuring changed code, never bytes on disk. The fixture was written by that code
(``tests/data/make_prev_main_store.py`` says how), not by a simulation of it."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data"))

from make_v1_store import state_checksum  # noqa: E402

from kvshelf import Identity, open_store  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
with open(os.path.join(DATA, "prev_main_store.expected.json")) as _f:
    EXPECTED = json.load(_f)


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "store"
    shutil.copytree(os.path.join(DATA, "prev_main_store"), root)  # an open may write (uses, the reserve)
    with open_store(root, identity=Identity(*EXPECTED["identity"]), chunk_tokens=EXPECTED["chunk_tokens"]) as s:
        yield s


def test_every_session_restores_bit_exact_and_the_store_verifies_clean(store):
    for name, want in EXPECTED["sessions"].items():
        r = store.restore(name, namespace=want["namespace"])
        assert r.tokens == want["tokens"]
        assert [state_checksum(c) for c in r.caches] == want["checksums"], name
    assert store.verify(deep=True) == []
    report = store.gc(dry_run=True)
    assert report.orphan_objects == [] and report.orphan_manifests == []


def test_prefix_reuse_checkpoints_pins_and_generations_read_as_written(store):
    chat = EXPECTED["sessions"]["chat"]["tokens"]
    hit = store.lookup(chat + [1, 2, 3])
    assert hit is not None and hit.length == len(chat)
    tenant = EXPECTED["sessions"]["tenant"]
    assert store.lookup(tenant["tokens"][:32] + [7], namespace="tenant-x").length == 32
    ckpt = EXPECTED["sessions"]["with-checkpoint"]
    (listed,) = store.list_checkpoints("with-checkpoint")
    assert listed.length == 24
    r = store.restore_snapshot(listed.snapshot_id)
    assert [state_checksum(c) for c in r.caches] == ckpt["checkpoint_24"] and r.tokens == ckpt["tokens"][:24]
    assert [p.session_id for p in store.pins.listing()] == ["pinned"]
    gen = EXPECTED["generation"]
    found = store.find_generation_checkpoint(gen["key"], gen["prompt"])
    assert found.tokens == gen["tokens"] and found.pending_token == gen["pending_token"]
    assert [state_checksum(c) for c in found.caches] == gen["checksums"]
