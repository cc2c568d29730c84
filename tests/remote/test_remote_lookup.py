"""The shared prefix index keeps the local rule (API.md "Usable prefix of a stored snapshot") across hosts: host B,
with nothing local, finds exactly the longest usable prefix over every snapshot host A published (a brute-force
oracle; floors and untrimmable caches mixed in), token-verified; the one prefix search gives the same length over
host A's own index and over the shared one; and the circuit breaker's states."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from lookup_oracle import IDENTITY, PROVIDER, caches, oracle, stores
from redis_servers import RedisServer

from kvshelf import open_store
from kvshelf.store.identity import namespace_key
from kvshelf.store.prefix.index_records import IndexRecords
from kvshelf.store.prefix.search import LazyTokens, PrefixSearch
from kvshelf.store.remote import CircuitBreaker
from kvshelf.store.remote.search import RedisRecords


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    server = RedisServer()
    root = tmp_path_factory.mktemp("remote-oracle")
    a = open_store(root / "a", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64, remote=server.url)
    b = open_store(root / "b", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64, remote=server.url,
                   remote_options={"keep_local": False})
    yield a, b
    a.close()
    b.close()
    server.close()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=stores())
def test_remote_lookup_finds_the_longest_usable_prefix_over_all_snapshots(two_hosts, case) -> None:
    snaps, prompt = case
    a, b = two_hosts
    ns = uuid.uuid4().hex
    for i, (tokens, trimmable, floor) in enumerate(snaps):
        a.save(f"s{i}", tokens, caches(len(tokens), trimmable, floor), namespace=ns)
    assert a.tier.flush(30)
    want = oracle(snaps, prompt)
    for form in (prompt, np.array(prompt, dtype=np.int64)):
        hit = b.lookup(form, namespace=ns)
        assert (0 if hit is None else hit.length) == want, (hit, want)
    assert b.sessions(namespace=ns) == []  # B holds nothing of it: every hit above came from the shared tier
    if hit is not None:
        tokens, trimmable, floor = snaps[int(hit.session_id[1:])]
        assert tokens[:want] == prompt[:want] and want >= floor and (trimmable or want == len(tokens))
        r = b.restore_prefix(prompt, namespace=ns)
        assert r.length == want and r.caches[0].offset == want and r.tokens == prompt[:want]


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=stores())
def test_one_search_gives_the_same_length_over_the_local_index_and_redis(two_hosts, case) -> None:
    """Host A holds its sessions locally and has published them: ``PrefixSearch`` over its index read transaction
    and over the Redis records finds the same (oracle) length; a prompt whose first token no snapshot starts with
    costs the Redis source one round trip."""
    snaps, prompt = case
    a, _ = two_hosts
    ns = uuid.uuid4().hex
    for i, (tokens, trimmable, floor) in enumerate(snaps):
        a.save(f"s{i}", tokens, caches(len(tokens), trimmable, floor), namespace=ns)
    assert a.tier.flush(30)
    nsk, want = namespace_key(a.id_key, ns), oracle(snaps, prompt)
    for form in (prompt, np.array(prompt, dtype=np.int64)):
        with a.index.read() as txn:
            local = PrefixSearch(IndexRecords(txn), nsk, LazyTokens(form)).run()
        redis = RedisRecords(a.tier.client, a.tier.keys, nsk)
        remote = PrefixSearch(redis, nsk, LazyTokens(form)).run()
        lengths = [0 if found is None else found.length for found in (local, remote)]
        assert lengths == [want, want], (lengths, want)
        if len(prompt) >= 2 and all(tokens[0] != prompt[0] for tokens, _, _ in snaps):
            assert redis.round_trips == 1


def test_unusable_neighbours_do_not_hide_a_usable_remote_snapshot(two_hosts) -> None:
    a, b = two_hosts
    system = list(range(100, 164))
    a.save("short", system + [1] * 20, caches(84, True, 0), namespace="rings")
    for k in range(40):
        toks = system + [7] * (10 + k % 5) + [9, k] + [3] * 30
        a.save(f"ring{k}", toks, caches(len(toks), False, 0), namespace="rings")
    assert a.tier.flush(30)
    hit = b.lookup(system + [7] * 16 + [8] * 40, namespace="rings")
    assert (hit.session_id, hit.length) == ("short", 64)


def test_a_forged_boundary_record_is_never_served(two_hosts) -> None:
    """A record under the right boundary key naming a snapshot whose tokens differ: the token check refuses it."""
    a, b = two_hosts
    toks = list(range(1, 80))
    a.save("real", toks, caches(len(toks), True, 0), namespace="forged")
    assert a.tier.flush(30)
    tier = b.tier
    client = tier.client
    other = list(range(1000, 1080))
    hit = b.lookup(other, namespace="forged")
    assert hit is None
    # copy every boundary record of "real" under the keys of the other prompt's boundaries
    from kvshelf.store.identity import namespace_key
    from kvshelf.store.prefix.hashing import all_boundaries, tokens_array

    nsk = namespace_key(b.id_key, "forged")
    real_keys = [tier.keys.boundary(nsk, h) for h, _ in all_boundaries(nsk, tokens_array(toks))]
    fake_keys = [tier.keys.boundary(nsk, h) for h, _ in all_boundaries(nsk, tokens_array(other))]
    for rk, fk in zip(real_keys, fake_keys):
        for member in client.zrange(rk, 0, -1):
            client.zadd(fk, {member: 0})
    assert b.lookup(other, namespace="forged") is None


def test_breaker_opens_backs_off_and_closes():
    now = [0.0]
    br = CircuitBreaker(failures=2, backoff=1.0, max_backoff=4.0, clock=lambda: now[0])
    assert br.allow() and br.state == "closed"
    br.failure()
    assert br.allow()
    br.failure()
    assert br.state == "open" and not br.allow() and br.short_circuited == 1
    now[0] = 1.3  # past the (jittered) backoff: one probe
    assert br.state == "half-open" and br.allow() and not br.allow()
    br.failure()  # the probe failed: a longer backoff
    now[0] = 2.5
    assert not br.allow()
    now[0] = 1.3 + 2.5
    assert br.allow()
    br.success()
    assert br.state == "closed" and br.allow() and br.opened == 2
