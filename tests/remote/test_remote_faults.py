"""The shared tier is never a source of harm: every fault is a clean miss or a bit-exact restore.

Real redis-server processes on 127.0.0.1: killed mid-fetch and mid-publish, flushed between lookup and fetch, a chunk
value replaced, maxmemory + allkeys-lru evicting part of a session, and a TCP proxy that stalls. After each, the local
stores verify clean and saves were never held up (counted, not timed).
"""

from __future__ import annotations

import socket
import threading

import mlx.core as mx
import numpy as np
import pytest
from redis_servers import RedisServer, redis_server  # noqa: F401  (fixture)

from kvshelf import Identity, open_store
from kvshelf.errors import SnapshotNotFound
from kvshelf.latent_legos import LatentGeometry, MLACache
from kvshelf.store.base import seams

IDENTITY = Identity("remote-test", config_fingerprint="cfg", tokenizer_hash="tok")
G = LatentGeometry(kv_lora_rank=16, rope_head_dim=8)
CHUNK = 32
# both fetch paths: replies read straight into the arrays (single server), and redis-py pipelines (clusters)
READS = pytest.mark.parametrize("direct", [True, False], ids=["direct-reads", "pipelined"])


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 30_000, size=n)]


def caches_for(toks: list[int], layers: int = 2) -> list[MLACache]:
    """Tensors are a pure function of (token, position): equal prefixes give equal chunks on every host."""
    t = np.asarray(toks, dtype=np.float32)[:, None]
    pos = np.arange(len(toks), dtype=np.float32)[:, None]
    out = []
    for layer in range(layers):
        latent = np.sin(t * 0.001 + np.arange(16)[None, :] * 0.1 + pos * 0.01 + layer)[None].astype(np.float32)
        rope = np.cos(t * 0.002 + np.arange(8)[None, :] * 0.3 + pos * 0.02 + layer)[None].astype(np.float32)
        c = MLACache(G)
        c.append_latent(mx.array(latent), mx.array(rope), None)
        out.append(c)
    return out


def bits_of(caches) -> list[bytes]:
    return [np.array(a).tobytes() for c in caches for a in c.state] + [repr([c.offset for c in caches]).encode()]


def host(path, remote, identity=IDENTITY, **options):
    options.setdefault("socket_timeout", 1.0)
    return open_store(path, identity, chunk_tokens=CHUNK, remote=remote, remote_options=options)


def published(store, toks, session="s", namespace=""):
    store.save(session, toks, caches_for(toks), namespace=namespace)
    assert store.tier.flush(30)
    return store


def check_outcome(store, prompt, expect_tokens):
    """A remote restore must be bit-exact or a clean miss (None), and the local store must stay consistent."""
    restored = store.restore_prefix(prompt)
    if restored is not None:
        assert restored.tokens == expect_tokens[:restored.length]
        assert bits_of(restored.caches) == bits_of(caches_for(expect_tokens[:restored.length]))
    assert store.verify(deep=True) == []
    return restored


@pytest.fixture
def hooks():
    yield seams
    seams.FETCH_HOOK.clear()
    seams.PUBLISH_HOOK.clear()


@READS
def test_server_killed_mid_fetch_is_a_clean_miss(tmp_path, hooks, direct):
    server = RedisServer()
    try:
        toks = tokens(256, seed=1)
        with host(tmp_path / "a", server.url) as a, \
                host(tmp_path / "b", server.url, fetch_batch_bytes=1, direct_reads=direct) as b:
            published(a, toks)
            hit = b.lookup(toks + [5])
            assert hit is not None and hit.length == 256
            batches = []

            def kill_after_first(i):
                batches.append(i)
                if i == 0:
                    server.kill()

            seams.FETCH_HOOK.append(kill_after_first)
            assert check_outcome(b, toks + [5], toks) is None
            assert batches == [0] and b.tier.counters["restore_misses"] >= 1
            assert b.sessions() == [] and a.restore("s").length == 256  # A's local copy is untouched
            assert b.lookup(toks + [5]) is None  # a dead remote is a miss
    finally:
        server.close()


def test_server_killed_mid_publish_leaves_local_store_whole(tmp_path, hooks):
    server = RedisServer()
    try:
        toks = tokens(256, seed=2)
        with host(tmp_path / "a", server.url) as a:
            uploads = []

            def kill_after_two(h):
                uploads.append(h)
                if len(uploads) == 2:
                    server.kill()

            seams.PUBLISH_HOOK.append(kill_after_two)
            info = a.save("s", toks, caches_for(toks))
            assert a.tier.flush(30)
            assert a.tier.counters["publish_failed"] == 1 and a.tier.counters["published"] == 0
            assert a.restore("s").snapshot_id == info.snapshot_id and a.verify(deep=True) == []
            server.start()  # back, empty: nothing half-published is ever found
            with host(tmp_path / "b", server.url) as b:
                assert b.lookup(toks + [1]) is None
    finally:
        server.close()


def test_connection_cut_mid_publish_leaves_no_index_entry(tmp_path, redis_server, hooks):
    proxy = StallingProxy(redis_server.port)
    toks = tokens(256, seed=9)
    try:
        with host(tmp_path / "a", proxy.url) as a:
            uploads = []

            def cut_after_two(h):
                uploads.append(h)
                if len(uploads) == 2:
                    proxy.close()

            seams.PUBLISH_HOOK.append(cut_after_two)
            a.save("s", toks, caches_for(toks))
            assert a.tier.flush(30) and a.tier.counters["publish_failed"] == 1
            assert a.verify(deep=True) == [] and a.restore("s").length == 256
        with host(tmp_path / "b", redis_server.url) as b:
            keys = {k.decode() for k in b.tier.client.scan_iter(match="kvshelf:*")}
            assert len([k for k in keys if k.startswith("kvshelf:chunks/")]) == 2  # what got through before the cut
            assert not [k for k in keys if ":s:" in k or ":m:" in k or ":b:" in k]  # no (half) index entry
            assert b.lookup(toks + [1]) is None
    finally:
        proxy.close()


def test_flushall_between_lookup_and_fetch(tmp_path, redis_server):
    toks = tokens(150, seed=3)
    with host(tmp_path / "a", redis_server.url) as a, host(tmp_path / "b", redis_server.url) as b:
        published(a, toks)
        hit = b.lookup(toks + [9])
        assert hit is not None and hit.length == 150
        redis_server.cli("FLUSHALL")
        with pytest.raises(SnapshotNotFound):
            b.restore_snapshot(hit.snapshot_id, hit.length)
        assert check_outcome(b, toks + [9], toks) is None
        assert b.tier.counters["restore_misses"] == 1


@READS
@pytest.mark.parametrize("damage", ["other-bytes", "truncated", "foreign-value"])
def test_replaced_chunk_is_detected_dropped_and_counted(tmp_path, redis_server, damage, direct):
    toks = tokens(160, seed=4)
    with host(tmp_path / "a", redis_server.url) as a, \
            host(tmp_path / "b", redis_server.url, direct_reads=direct) as b:
        published(a, toks)
        manifest = a.admin.manifest(a.restore("s").snapshot_id)
        key = b.tier.keys.chunk(manifest.chunks[1].hash)
        value = b.tier.client.get(key)
        bad = {"other-bytes": value[:-8] + b"\x00" * 8, "truncated": value[: len(value) // 2],
               "foreign-value": b"not a chunk"}[damage]
        b.tier.client.set(key, bad)
        assert check_outcome(b, toks + [1], toks) is None
        assert b.tier.counters["corrupt_chunks"] == 1 and b.tier.counters["dropped_entries"] == 1
        assert b.tier.client.get(key) is None  # the bad value is gone
        assert b.lookup(toks + [1]) is None  # and so is the index entry that led to it
        published(a, toks, session="again")  # a later publish repairs the tier
        assert check_outcome(b, toks + [1], toks).length == 160


def test_maxmemory_eviction_of_part_of_a_session(tmp_path):
    server = RedisServer(["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "3"])
    try:
        with host(tmp_path / "a", server.url) as a, host(tmp_path / "b", server.url) as b:
            sessions = {f"s{i}": tokens(1200, seed=100 + i) for i in range(6)}
            for name, toks in sessions.items():
                published(a, toks, session=name)
            evicted = int(server.cli("INFO", "stats").split("evicted_keys:")[1].split()[0])
            assert evicted > 0
            outcomes = [check_outcome(b, toks + [7], toks) for toks in sessions.values()]
            assert b.sessions() == [f for f in b.sessions() if f.session_id.startswith("remote/")]
            served = [o for o in outcomes if o is not None]
            assert len(served) < len(sessions)  # some session lost part of itself: missed, not half-restored
            assert b.tier.counters["corrupt_chunks"] == 0
    finally:
        server.close()


class StallingProxy:
    """A loopback TCP proxy; while ``stall`` is set it forwards nothing (and counts the bytes it holds back)."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stall = threading.Event()
        self.resume = threading.Event()
        self.held = 0
        self.dead = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.dead:
                client.close()
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                if self.stall.is_set():
                    self.held += len(data)
                    self.resume.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def set_stalled(self, on: bool) -> None:
        if on:
            self.resume.clear()
            self.stall.set()
        else:
            self.stall.clear()
            self.resume.set()

    def close(self) -> None:
        self.set_stalled(False)
        self.dead = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone would not)
        except OSError:
            pass
        self.listener.close()
        for s in self.socks:  # shutdown first: it wakes the forwarding threads and resets both peers
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_stalling_network_never_blocks_saves_and_lookups_miss(tmp_path, redis_server):
    proxy = StallingProxy(redis_server.port)
    try:
        toks = tokens(128, seed=5)
        with host(tmp_path / "a", proxy.url, socket_timeout=0.3, queue_size=1) as a, \
                host(tmp_path / "b", proxy.url, socket_timeout=0.3) as b:
            published(a, toks)
            published_before = a.tier.counters["published"]
            proxy.set_stalled(True)
            for i in range(4):  # the publisher is stuck on the stalled socket; saves return regardless
                a.save(f"stalled-{i}", toks[:100 + i], caches_for(toks[:100 + i]))
            assert proxy.stall.is_set()  # every save above returned while the network was stalled
            assert a.tier.counters["publish_dropped"] >= 2  # bounded queue: the excess was dropped and counted
            assert [s.session_id for s in a.sessions() if s.session_id.startswith("stalled")] != []
            assert b.lookup(toks + [3]) is None  # timed out: a miss (and the breaker learns of it)
            assert b.tier.counters["lookup_errors"] == 1
            assert proxy.held > 0
            proxy.set_stalled(False)
            assert a.tier.flush(30)
            assert a.tier.counters["published"] >= published_before
            assert a.verify(deep=True) == [] and b.verify(deep=True) == []
    finally:
        proxy.close()


def test_unreachable_remote_is_a_miss_and_the_breaker_opens(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    toks = tokens(64, seed=6)
    with host(tmp_path / "a", f"redis://127.0.0.1:{port}/0", connect_timeout=0.2) as a:
        for i in range(5):
            a.save(f"s{i}", toks, caches_for(toks))
        assert a.tier.flush(30)
        for _ in range(5):
            assert a.lookup([9, 9, 9, 9]) is None
        tier = a.tier
        assert tier.counters["published"] == 0
        assert tier.counters["publish_failed"] + tier.counters["publish_dropped"] == 5
        assert tier.breaker.opened >= 1 and tier.breaker.short_circuited >= 1
        assert a.restore_prefix(toks + [1]).length == 64  # the local store serves as before


def test_identity_and_namespace_isolation_across_hosts(tmp_path, redis_server):
    toks = tokens(100, seed=7)
    other = Identity("remote-test", config_fingerprint="cfg-2", tokenizer_hash="tok")
    with host(tmp_path / "a", redis_server.url) as a, host(tmp_path / "b", redis_server.url, identity=other) as b, \
            host(tmp_path / "c", redis_server.url) as c:
        published(a, toks, namespace="tenant-1")
        assert b.lookup(toks + [1], namespace="tenant-1") is None  # another model config never sees it
        assert c.lookup(toks + [1]) is None  # same model, other namespace
        assert c.lookup(toks + [1], namespace="tenant-2") is None
        hit = c.lookup(toks + [1], namespace="tenant-1")
        assert hit is not None and hit.namespace == "tenant-1"
        assert c.restore_prefix(toks + [1], namespace="tenant-1").length == 100


def test_two_hosts_publishing_the_same_prefix_at_once(tmp_path, redis_server):
    toks = tokens(300, seed=8)
    hosts = [host(tmp_path / f"h{i}", redis_server.url) for i in range(2)]
    try:
        start = threading.Barrier(2)

        def save(i):
            start.wait()
            hosts[i].save(f"same-{i}", toks, caches_for(toks))

        threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(h.tier.flush(30) for h in hosts)
        assert sum(h.tier.counters["published"] for h in hosts) == 2
        n_chunks = len(list(hosts[0].tier.client.scan_iter(match="kvshelf:chunks/*")))
        assert n_chunks == 300 // CHUNK + 1  # content-addressed: one copy of each chunk
        with host(tmp_path / "third", redis_server.url) as third:
            hit = third.lookup(toks + [4])
            assert hit is not None and hit.session_id in ("same-0", "same-1") and hit.length == 300
            assert check_outcome(third, toks + [4], toks).length == 300
    finally:
        for h in hosts:
            h.close()
