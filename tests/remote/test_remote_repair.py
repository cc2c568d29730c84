"""``repair`` takes a good copy of a damaged local chunk from the shared tier (a real redis-server on 127.0.0.1):
through the tier a handle was opened with, and through ``kvshelf repair --remote URL`` on a store opened offline.
The tier's copy is verified by the chunk's name before it is written; a damaged remote copy is not used (and is
deleted from the server, as a restore would), and the sessions are then reported lost."""

from __future__ import annotations

import redis
from redis_servers import free_port, redis_server  # noqa: F401  (fixture)
from store_cases import flip_chunk_byte
from tools_data import run_json

from kvshelf import open_store
from test_remote_faults import CHUNK, IDENTITY, bits_of, caches_for, host, published, tokens


def _damaged(tmp_path, url):
    """A store whose session ``s`` was published, then one of its chunks damaged on local disk."""
    toks = tokens(160, seed=11)
    root = tmp_path / "a"
    with host(root, url) as a:
        published(a, toks)
        h = a.admin.manifest(a.restore("s").snapshot_id).chunks[1].hash
        flip_chunk_byte(a, h)
    return root, toks, h


def test_repair_heals_a_damaged_chunk_from_the_tier_the_handle_uses(tmp_path, redis_server) -> None:
    root, toks, h = _damaged(tmp_path, redis_server.url)
    with host(root, redis_server.url) as a:
        report = a.repair(dry_run=False)
        assert [(c["chunk"], c["sessions"]) for c in report.healed] == [(h, ["s"])]
        assert report.healed[0]["source"].startswith("shared tier") and report.lost == []
        assert report.remaining == [] and a.verify(deep=True) == []
        got = a.restore("s")
        assert bits_of(got.caches) == bits_of(caches_for(toks)) and a.tier.counters["chunks_fetched"] >= 1


def test_cli_repair_remote_heals_an_offline_store(tmp_path, redis_server) -> None:
    root, toks, h = _damaged(tmp_path, redis_server.url)
    doc = run_json("verify", "--deep", "--store", str(root), expect_rc=1)
    assert [(p["kind"], p["session_id"]) for p in doc["problems"]] == [("corrupt-chunk", "s")]
    without = run_json("repair", "--dry-run", "--store", str(root))
    assert without["healed"] == [] and [r["session_id"] for r in without["lost"]] == ["s"]
    dry = run_json("repair", "--dry-run", "--remote", redis_server.url, "--store", str(root))
    assert [c["chunk"] for c in dry["healed"]] == [h] and dry["lost"] == []
    done = run_json("repair", "--remote", redis_server.url, "--store", str(root))
    assert [c["chunk"] for c in done["healed"]] == [h] and done["lost"] == [] and done["remaining"] == []
    run_json("verify", "--deep", "--store", str(root))
    with open_store(root, IDENTITY, chunk_tokens=CHUNK) as a:
        assert bits_of(a.restore("s").caches) == bits_of(caches_for(toks))


def test_a_damaged_copy_on_the_tier_is_not_used(tmp_path, redis_server) -> None:
    root, toks, h = _damaged(tmp_path, redis_server.url)
    key = f"kvshelf:chunks/{h}"
    client = redis.Redis.from_url(redis_server.url)
    value = client.get(key)
    client.set(key, value[:-8] + b"\0" * 8)
    done = run_json("repair", "--remote", redis_server.url, "--store", str(root))
    assert done["healed"] == [] and [r["session_id"] for r in done["lost"]] == ["s"] and done["remaining"] == []
    assert client.get(key) is None  # deleted from the server: the next publish of the content uploads fresh bytes
    client.close()


def test_an_unreachable_tier_heals_nothing_and_repair_still_reports(tmp_path, redis_server) -> None:
    """The tier named to repair is down: no copy comes from it (asked once, not per chunk), the loss is reported,
    and repair exits cleanly."""
    root, toks, h = _damaged(tmp_path, redis_server.url)
    down = f"redis://127.0.0.1:{free_port()}/0"
    dry = run_json("repair", "--dry-run", "--remote", down, "--store", str(root))
    assert dry["healed"] == [] and [r["session_id"] for r in dry["lost"]] == ["s"]
