"""``kvshelf gc --remote`` removes what no remote index entry references — never what a publisher is about to use —
and ``kvshelf ls/stats --remote`` show the shared tier (the CLI run as a subprocess against a real redis-server)."""

from __future__ import annotations

import threading

import pytest
from redis_servers import _cluster_servers, redis_cluster, redis_server  # noqa: F401  (fixtures)
from test_remote_faults import bits_of, caches_for, host, published, tokens
from tools_data import run_json

from kvshelf.store.base import seams
from kvshelf.store.remote.maintenance import RemoteAdmin


@pytest.fixture
def hooks():
    yield seams
    seams.PUBLISH_HOOK.clear()


def chunk_keys(client) -> set[str]:
    return {k.decode() for k in client.scan_iter(match="kvshelf:chunks/*")}


def test_gc_removes_unreferenced_chunks_and_keeps_the_rest(tmp_path, redis_server):
    toks = tokens(200, seed=20)
    with host(tmp_path / "a", redis_server.url) as a, RemoteAdmin(redis_server.url) as admin:
        published(a, toks)
        referenced = chunk_keys(admin.client)
        admin.client.set("kvshelf:chunks/" + "0" * 32, b"left by a crashed publisher")
        admin.client.set("other-app:key", b"not ours")
        dry = admin.gc(dry_run=True)
        assert dry["chunks"] == 1 and chunk_keys(admin.client) == referenced | {"kvshelf:chunks/" + "0" * 32}
        report = admin.gc()
        assert report["chunks"] == 1 and report["entries_dropped"] == 0 and report["skipped"] == ""
        assert chunk_keys(admin.client) == referenced and admin.client.get("other-app:key") == b"not ours"
        with host(tmp_path / "b", redis_server.url) as b:
            restored = b.restore_prefix(toks + [1])
            assert restored.length == 200 and bits_of(restored.caches) == bits_of(caches_for(toks))


def test_gc_drops_entries_that_lost_a_chunk(tmp_path, redis_server):
    toks = tokens(200, seed=21)
    with host(tmp_path / "a", redis_server.url) as a, RemoteAdmin(redis_server.url) as admin:
        published(a, toks)
        victim = sorted(chunk_keys(admin.client))[0]
        admin.client.delete(victim)  # as an eviction would
        report = admin.gc()
        assert report["entries_dropped"] == 1 and report["chunks"] == 200 // 32  # the entry's other chunks
        assert chunk_keys(admin.client) == set()
        assert [k for k in admin.client.scan_iter(match="kvshelf:*")] == []  # boundary records went too
        with host(tmp_path / "b", redis_server.url) as b:
            assert b.lookup(toks + [1]) is None


def test_gc_waits_for_a_publish_in_progress(tmp_path, redis_server, hooks):
    toks = tokens(200, seed=22)
    uploading, release = threading.Event(), threading.Event()

    def pause(_hash):
        uploading.set()
        release.wait(30)

    with host(tmp_path / "a", redis_server.url) as a, RemoteAdmin(redis_server.url) as admin:
        seams.PUBLISH_HOOK.append(pause)
        a.save("s", toks, caches_for(toks))
        assert uploading.wait(30)
        report = admin.gc(wait=0.2)  # the first chunk is uploaded, its entry not yet committed
        assert report["skipped"] == "a publish is in progress" and len(chunk_keys(admin.client)) == 1
        seams.PUBLISH_HOOK.clear()
        release.set()
        assert a.tier.flush(30) and a.tier.counters["published"] == 1
        assert admin.gc()["chunks"] == 0
        with host(tmp_path / "b", redis_server.url) as b:
            assert b.restore_prefix(toks + [1]).length == 200


def test_publisher_does_not_start_while_gc_runs(tmp_path, redis_server):
    toks = tokens(100, seed=23)
    with host(tmp_path / "a", redis_server.url) as a, RemoteAdmin(redis_server.url) as admin:
        admin.client.set(admin.keys.gc, "someone", px=60_000)  # a gc in progress elsewhere
        published(a, toks)
        assert a.tier.counters["publish_skipped"] == 1 and chunk_keys(admin.client) == set()
        assert admin.gc()["skipped"] == "another gc is running"
        admin.client.delete(admin.keys.gc)
        published(a, toks, session="later")
        assert a.tier.counters["published"] == 1


def test_cli_ls_stats_gc_remote(tmp_path, redis_server):
    toks = tokens(150, seed=24)
    with host(tmp_path / "a", redis_server.url) as a:
        published(a, toks, session="shown", namespace="tenant")
    listed = run_json("ls", "--remote", redis_server.url, "--json")["remote"]
    assert [(r["session_id"], r["namespace"], r["tokens"]) for r in listed] == [("shown", "tenant", 150)]
    stats = run_json("stats", "--remote", redis_server.url, "--json")
    assert stats["entries"] == 1 and stats["chunks"] == 150 // 32 + 1 and stats["unreferenced_chunks"] == 0
    assert stats["server"].startswith(("redis", "valkey")) and stats["chunk_bytes"] > 0
    assert run_json("gc", "--remote", redis_server.url, "--dry-run", "--json")["chunks"] == 0
    other = run_json("ls", "--remote", redis_server.url, "--remote-prefix", "elsewhere:", "--json")
    assert other["remote"] == []


def test_cli_remote_unreachable_exits_1(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    doc = run_json("stats", "--remote", f"redis://127.0.0.1:{port}/0", "--json", expect_rc=1)
    assert doc["error"] == "BackendUnavailable"


@pytest.mark.slow
def test_gc_and_listing_across_a_cluster(tmp_path, redis_cluster):
    with host(tmp_path / "a", redis_cluster.url) as a, RemoteAdmin(redis_cluster.url) as admin:
        for i in range(3):
            published(a, tokens(200, seed=30 + i), session=f"s{i}")
        assert len(admin.entries()) == 3 and admin.stats()["nodes"] == 3
        admin.client.set("kvshelf:chunks/" + "f" * 32, b"orphan")
        assert admin.gc()["chunks"] == 1 and admin.stats()["unreferenced_chunks"] == 0
        with host(tmp_path / "b", redis_cluster.url) as b:
            for i in range(3):
                toks = tokens(200, seed=30 + i)
                restored = b.restore_prefix(toks + [1])
                assert restored.length == 200 and bits_of(restored.caches) == bits_of(caches_for(toks))
