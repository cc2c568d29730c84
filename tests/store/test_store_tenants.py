"""Tenants through the library API (``tenant=`` on the session calls): a tenant is a namespace scope, so two tenants
never see each other's sessions, prefixes or checkpoints, and the default tenant is the store as it always was."""

from __future__ import annotations

import pytest
from codec_cases import CASES_BY_ID
from store_cases import open_test_store, same_caches, session, token_ids

from kvshelf.errors import InvalidCacheState, SnapshotNotFound
from kvshelf.store import scoped_namespace

MLA = CASES_BY_ID["mla-f32-nodsa"]


def mla(n, seed=0):
    return session(MLA, (n,), seed)


def test_a_tenant_sees_only_its_own_sessions_and_prefixes(tmp_path):
    prompt, caches = token_ids(48, seed=1), mla(48, seed=1)
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        store.save("chat", prompt, caches, tenant="alice")
        assert store.lookup(prompt + [7], tenant="alice").length == 48
        assert store.lookup(prompt + [7], tenant="bob") is None  # same prompt, other tenant: a miss
        assert store.lookup(prompt + [7]) is None  # nor the default tenant
        assert store.restore_prefix(prompt, tenant="bob") is None
        with pytest.raises(SnapshotNotFound):
            store.restore("chat", tenant="bob")
        same_caches(store.restore("chat", tenant="alice").caches, caches)
        # the keyword is the namespace scope serve composes itself
        assert store.restore("chat", scoped_namespace("", "alice")).length == 48
        store.save("chat", prompt, mla(48, seed=2), "work", tenant="bob")
        assert [s.session_id for s in store.sessions(tenant="alice")] == ["chat"]
        assert [s.namespace for s in store.sessions(tenant="bob")] == [scoped_namespace("work", "bob")]
        assert store.sessions("work", tenant="alice") == [] and store.sessions(tenant="carol") == []
        assert len(store.sessions()) == 2  # without a tenant: every tenant's (as before tenants)
        store.pin("chat", "work", tenant="bob")
        assert store.unpin("chat", "work", tenant="bob")
        store.delete("chat", tenant="alice")
        assert store.sessions(tenant="alice") == [] and len(store.sessions(tenant="bob")) == 1


def test_a_full_length_namespace_fits_inside_a_tenant_and_bad_tenants_are_refused(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        ns = "n" * 256
        store.save("s", token_ids(16), mla(16), ns, tenant="t" * 200)  # a long tenant becomes a digest
        assert store.restore("s", ns, tenant="t" * 200).length == 16
        for bad in ("x" * 257, "a\x00b"):
            with pytest.raises(InvalidCacheState, match="tenant"):
                store.save("s", token_ids(16), mla(16), tenant=bad)
        with pytest.raises(InvalidCacheState, match="namespace"):
            store.save("s", token_ids(16), mla(16), "n" * 257, tenant="t")


PER_TOKEN = 2 * (64 + 32) * 4  # two f32 MLA layers of widths 64 + 32
SNAP = 48 * PER_TOKEN


def test_a_tenant_flooding_the_store_evicts_only_its_own_sessions(tmp_path):
    with open_test_store(tmp_path / "s", chunk_tokens=16, tenant_max_bytes={"a": 3 * SNAP}) as store:
        for i in range(4):
            store.save(f"b-{i}", token_ids(48, seed=100 + i), mla(48, seed=100 + i), tenant="b")
        store.save("a-pinned", token_ids(48, seed=50), mla(48, seed=50), tenant="a")
        store.pin("a-pinned", tenant="a")
        for i in range(30):  # ten times its quota
            store.save(f"a-{i}", token_ids(48, seed=i), mla(48, seed=i), tenant="a")
            used = sum(s.nbytes for s in store.sessions(tenant="a"))
            assert used <= 3 * SNAP
        assert {s.session_id for s in store.sessions(tenant="b")} == {f"b-{i}" for i in range(4)}
        assert {s.session_id for s in store.sessions(tenant="a")} == {"a-pinned", "a-28", "a-29"}  # the pin counts
        assert store.counters["evicted"] == 28
        store.set_tenant_limit("*", SNAP)  # every tenant's default quota, from its next save
        store.save("b-4", token_ids(48, seed=104), mla(48, seed=104), tenant="b")
        assert [s.session_id for s in store.sessions(tenant="b")] == ["b-4"]
        assert len(store.sessions(tenant="a")) == 3  # a's own quota still applies to a alone
        with pytest.raises(InvalidCacheState, match="quota"):
            store.set_tenant_limit("a", -1)


def test_opening_with_a_quota_evicts_a_tenant_left_over_it(tmp_path):
    """A writer killed between a save's commit and its eviction leaves its tenant over quota (the same state as a
    store filled before the quota was set): the next open with the quota evicts that tenant's least recently used
    snapshots down to it at once, never another tenant's, never a pinned one — not only at that tenant's next save,
    which an idle tenant never makes."""
    with open_test_store(tmp_path / "s", chunk_tokens=16) as store:
        store.save("a-pinned", token_ids(48, seed=50), mla(48, seed=50), tenant="a")
        store.pin("a-pinned", tenant="a")
        for i in range(4):
            store.save(f"a-{i}", token_ids(48, seed=i), mla(48, seed=i), tenant="a")
            store.save(f"b-{i}", token_ids(48, seed=100 + i), mla(48, seed=100 + i), tenant="b")
    with open_test_store(tmp_path / "s", chunk_tokens=16, tenant_max_bytes={"a": 3 * SNAP}) as store:
        assert {s.session_id for s in store.sessions(tenant="a")} == {"a-pinned", "a-2", "a-3"}
        assert len(store.sessions(tenant="b")) == 4  # b has no quota of its own and no "*"
        assert store.counters["evicted"] == 2
