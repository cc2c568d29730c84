"""Forgetting a tenant (``store.forget_tenant``, ``kvshelf forget --tenant``) on a real store and a real
redis-server: every snapshot, prefix checkpoint, generation checkpoint, pin and shared-tier entry of the tenant goes,
another tenant's stay; ``kvshelf ls --tenant`` and ``kvshelf stats`` show tenants."""

from __future__ import annotations

from redis_servers import redis_server  # noqa: F401  (fixture)
from test_remote_faults import bits_of, caches_for, host, tokens
from tools_data import run_json

from kvshelf.store import scoped_namespace, tenant_of, tenant_token
from kvshelf.store.remote.maintenance import RemoteAdmin


def fill(store, tenant, toks):
    store.save("chat", toks, caches_for(toks), checkpoints={64: caches_for(toks[:64])}, tenant=tenant)
    store.save_generation_checkpoint("gen-1", toks + [5, 6], caches_for(toks + [5, 6]), prompt_length=len(toks) + 1,
                                     pending_token=7, sampler_state=None, tenant=tenant)
    store.pin("chat", tenant=tenant)
    assert store.tier.flush(30)


def tenants_in(admin) -> set[str]:
    return {tenant_of(e["namespace"]) for e in admin.entries()}


def test_forget_removes_every_record_of_the_tenant_and_nothing_of_another(tmp_path, redis_server):
    toks = tokens(160, seed=30)
    with host(tmp_path / "a", redis_server.url) as store, RemoteAdmin(redis_server.url) as admin:
        fill(store, "alice", toks)
        fill(store, "bob", toks)
        assert tenants_in(admin) == {"alice", "bob"}
        assert store.find_generation_checkpoint("gen-1", toks + [5], tenant="alice") is not None
        assert store.find_generation_checkpoint("gen-1", toks + [5], tenant="carol") is None
        report = store.forget_tenant("alice")
        assert report["snapshots"] == 3 and report["remote_entries"] == 3  # session, its checkpoint, the generation
        assert store.sessions(tenant="alice") == [] and store.list_checkpoints("chat", tenant="alice") == []
        assert store.find_generation_checkpoint("gen-1", toks + [5], tenant="alice") is None
        assert store.lookup(toks + [1], tenant="alice") is None
        assert [p.namespace for p in store.pins.listing()] == [scoped_namespace("", "bob")]
        assert tenants_in(admin) == {"bob"}
        restored = store.restore_prefix(toks + [1], tenant="bob")
        assert restored.length == 160 and bits_of(restored.caches) == bits_of(caches_for(toks))
        assert store.verify(deep=True) == []
    with host(tmp_path / "b", redis_server.url) as other:  # a second host finds nothing of alice through the tier
        assert other.lookup(toks + [1], tenant="alice") is None
        assert other.lookup(toks + [1], tenant="bob").length == 160


def test_the_cli_lists_counts_and_forgets_a_tenant(tmp_path, redis_server):
    toks = tokens(96, seed=31)
    with host(tmp_path / "s", redis_server.url) as store:
        for tenant, n in (("alice", 2), ("bob", 1)):
            for i in range(n):
                store.save(f"c{i}", toks, caches_for(toks), tenant=tenant)
        store.save("plain", toks, caches_for(toks))
        assert store.tier.flush(30)
    where = ("--store", str(tmp_path / "s"))
    assert {r["session_id"] for r in run_json("ls", *where, "--tenant", "alice")["sessions"]} == {"c0", "c1"}
    stats = run_json("stats", *where)["tenants"]
    assert {t: r["sessions"] for t, r in stats.items()} == {"": 1, "alice": 2, "bob": 1}
    assert len(run_json("ls", "--remote", redis_server.url, "--tenant", "bob")["remote"]) == 1
    assert run_json("forget", *where, "--tenant", "alice")["snapshots"] == 2
    assert run_json("forget", "--remote", redis_server.url, "--tenant", "alice")["remote_entries"] == 2
    assert set(run_json("stats", *where)["tenants"]) == {"", "bob"}
    with RemoteAdmin(redis_server.url) as admin:
        assert tenants_in(admin) == {"", tenant_token("bob")}


def test_the_cli_reads_an_encrypted_store_with_its_key_file(tmp_path):
    from kvshelf import open_store
    from test_remote_faults import IDENTITY

    toks = tokens(96, seed=32)
    key_file = tmp_path / "key"
    key_file.write_text(bytes(range(32)).hex() + "\n")  # 64 hex digits: a raw key written as text
    with open_store(tmp_path / "s", IDENTITY, chunk_tokens=32, key=bytes(range(32))) as store:
        store.save("c", toks, caches_for(toks), tenant="alice")
    where = ("--store", str(tmp_path / "s"))
    blind = run_json("verify", *where, "--deep", expect_rc=1)  # without the key: the plaintext checks it skipped
    assert blind["problems"] and {f["kind"] for f in blind["problems"]} == {"not-checked"}
    assert run_json("verify", *where, "--deep", "--encryption-key-file", str(key_file))["problems"] == []
    key_file.write_text("not the passphrase")
    wrong = run_json("verify", *where, "--encryption-key-file", str(key_file), expect_rc=1)
    assert wrong["error"] == "EncryptionKeyError" and str(tmp_path / "s") in wrong["message"]
    assert "not the passphrase" not in wrong["message"]
    assert run_json("forget", *where, "--tenant", "alice")["key_destroyed"] == 1  # no key needed to destroy one
