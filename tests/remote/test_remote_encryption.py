"""Encryption at rest (``open_store(path, key=...)``) on a real store and a real redis-server: no pack file and no
Redis value holds a run of the plaintext tensor bytes, the right key restores bit-exact, a wrong or missing key is a
clear ``EncryptionKeyError`` naming the store, a flipped byte in a sealed chunk is caught and healed as today, two
tenants' identical content gets different chunk names, and ``forget_tenant`` destroys the tenant's key first, so
even a copy of the store taken before cannot be read for that tenant."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from redis_servers import redis_server  # noqa: F401  (fixture)
from store_cases import chunk_file, flip_chunk_byte
from test_remote_faults import CHUNK, IDENTITY, bits_of, caches_for, host, tokens

from kvshelf import open_store
from kvshelf.errors import CorruptData, EncryptionKeyError
from kvshelf.store.objects.sealing import SEAL_MAGIC
from kvshelf.store.remote.maintenance import RemoteAdmin

KEY = bytes(range(32))


def ehost(path, remote, key=KEY):
    """A host of the shared tier whose store is encrypted at rest."""
    return open_store(path, IDENTITY, chunk_tokens=CHUNK, remote=remote, remote_options={"socket_timeout": 1.0},
                      key=key)


def plaintext_blocks(caches) -> set[bytes]:
    """Every 32-byte aligned block of the tensors' bytes (any 64-byte run of them contains one), minus constant ones."""
    out = set()
    for c in caches:
        for a in c.state:
            raw = bytes(memoryview(__import__("numpy").array(a)).cast("B"))
            out.update(b for i in range(0, len(raw) - 31, 32) if len(set(b := raw[i:i + 32])) > 1)
    return out


def leaks(blobs: list[bytes], blocks: set[bytes]) -> int:
    return sum(1 for b in blocks if any(b in blob for blob in blobs))


def pack_bytes(root: Path) -> list[bytes]:
    return [p.read_bytes() for p in (root / "packs").rglob("*") if p.is_file()]


def redis_values(client) -> list[bytes]:
    return [v for k in client.scan_iter(match="kvshelf:*") if client.type(k) == b"string" and (v := client.get(k))]


def test_nothing_at_rest_holds_plaintext_and_the_key_restores_bit_exact(tmp_path, redis_server):
    toks = tokens(160, seed=40)
    blocks = plaintext_blocks(caches_for(toks))
    assert len(blocks) > 100
    with host(tmp_path / "plain", redis_server.url) as plain:  # the check finds plaintext where there is some
        plain.save("s", toks, caches_for(toks))
        assert plain.tier.flush(30)
        assert leaks(pack_bytes(tmp_path / "plain"), blocks) > 0
    with RemoteAdmin(redis_server.url) as admin:
        assert leaks(redis_values(admin.client), blocks) > 0
        admin.client.flushall()
    with ehost(tmp_path / "enc", redis_server.url) as store:
        store.save("s", toks, caches_for(toks), tenant="alice")
        assert store.tier.flush(30)
    assert leaks(pack_bytes(tmp_path / "enc"), blocks) == 0
    with RemoteAdmin(redis_server.url) as admin:
        values = redis_values(admin.client)
        assert values and leaks(values, blocks) == 0
    with ehost(tmp_path / "enc", redis_server.url) as store:
        restored = store.restore("s", tenant="alice")
        assert bits_of(restored.caches) == bits_of(caches_for(toks))
        assert store.verify(deep=True) == []
    with ehost(tmp_path / "other", redis_server.url) as other:  # a second host, through the tier: another store's
        assert other.restore_prefix(toks + [1], tenant="alice") is None  # tenant keys are its own: a clean miss
    with RemoteAdmin(redis_server.url) as admin:  # and the values it could not open are left for their owner
        assert sorted(redis_values(admin.client)) == sorted(values)


def test_a_wrong_or_missing_key_is_a_clear_error_naming_the_store(tmp_path):
    root = tmp_path / "s"
    toks = tokens(64, seed=41)
    with open_store(root, IDENTITY, chunk_tokens=32, key=KEY) as store:
        store.save("s", toks, caches_for(toks))
    for wrong in (bytes(32), "a passphrase", None):
        with pytest.raises(EncryptionKeyError, match=str(root)) as info:
            open_store(root, IDENTITY, key=wrong)
        assert KEY.hex() not in str(info.value)
    with pytest.raises(EncryptionKeyError, match="32 bytes"):
        open_store(root, IDENTITY, key=b"short")
    with open_store(root, admin=True) as blind:  # offline tools open it without the key: chunk reads say why not
        first = blind.admin.manifest(next(iter(blind.admin.summaries()))).chunks[0].hash
        with pytest.raises(EncryptionKeyError, match=f"{root} is encrypted at rest: reading chunk {first} needs"):
            blind.admin.open_chunk(first)
    with open_store(tmp_path / "p", IDENTITY, chunk_tokens=32, key="correct horse") as store:
        store.save("s", toks, caches_for(toks))
    with open_store(tmp_path / "p", IDENTITY, chunk_tokens=32, key="correct horse") as store:
        assert bits_of(store.restore("s").caches) == bits_of(caches_for(toks))
    with pytest.raises(EncryptionKeyError, match="key check fails"):
        open_store(tmp_path / "p", IDENTITY, key="wrong horse")


def test_a_flipped_byte_in_a_sealed_chunk_is_caught_and_healed_by_a_resave(tmp_path):
    toks = tokens(96, seed=42)
    with open_store(tmp_path / "s", IDENTITY, chunk_tokens=32, key=KEY) as store:
        infos = [store.save(s, toks, caches_for(toks)) for s in "abc"]  # every chunk shared by the three
        bad = store.admin.manifest(infos[0].snapshot_id).chunks[1].hash
        flip_chunk_byte(store, bad)
        with pytest.raises(CorruptData, match="authentication tag"):
            store.restore("a")
        assert "bad-chunk" in {f.kind for f in store.verify()}
        again = store.save("a", toks, caches_for(toks))
        assert again.chunks_written == 1  # a fresh sealed copy of the bad chunk, nothing more
        for s in "abc":
            assert bits_of(store.restore(s).caches) == bits_of(caches_for(toks))
        assert store.verify(deep=True) == []


def test_identical_content_gets_different_names_per_tenant_and_dedups_within_one(tmp_path):
    toks = tokens(96, seed=43)
    with open_store(tmp_path / "s", IDENTITY, chunk_tokens=32, key=KEY) as store:
        names = {}
        for tenant in ("alice", "bob"):
            info = store.save("s", toks, caches_for(toks), tenant=tenant)
            names[tenant] = {r.hash for r in store.admin.manifest(info.snapshot_id).all_chunks}
        assert names["alice"] and not names["alice"] & names["bob"]
        again = store.save("t", toks, caches_for(toks), tenant="alice")
        assert again.chunks_written == 0 and again.bytes_reused > 0


def test_forget_destroys_the_key_so_a_copy_taken_before_cannot_be_read(tmp_path, redis_server):
    root, toks = tmp_path / "s", tokens(96, seed=44)
    with ehost(root, redis_server.url) as store:
        for tenant in ("alice", "bob"):
            store.save("s", toks, caches_for(toks), tenant=tenant)
        assert store.tier.flush(30)
        keys_before = set(store._ctx.keys.key_ids())
        shutil.copytree(root, tmp_path / "copy", ignore=shutil.ignore_patterns("*.lock", "keys"))
        with RemoteAdmin(redis_server.url) as admin:
            redis_copy = {k: admin.client.get(k) for k in admin.client.scan_iter(match="kvshelf:chunks/*")}
        report = store.forget_tenant("alice")
        assert report["key_destroyed"] == 1 and report["snapshots"] == 1 and report["remote_entries"] == 1
        assert len(store._ctx.keys.key_ids()) == len(keys_before) - 1
        assert store.sessions(tenant="alice") == []
        assert bits_of(store.restore("s", tenant="bob").caches) == bits_of(caches_for(toks))
    # the copy, given the store's surviving keys and the master key: bob reads, alice never
    shutil.copytree(root / "keys", tmp_path / "copy" / "keys")
    with open_store(tmp_path / "copy", IDENTITY, chunk_tokens=32, key=KEY) as copy:
        assert bits_of(copy.restore("s", tenant="bob").caches) == bits_of(caches_for(toks))
        with pytest.raises(CorruptData, match="holds no data key .* forgotten"):  # unreadable, never garbage
            copy.restore("s", tenant="alice")
        for name, value in redis_copy.items():  # nor does any Redis value copied before
            try:
                copy._ctx.keys.open_chunk(name.decode().rsplit("/", 1)[1], value, "a copied value")
            except EncryptionKeyError:
                continue
            assert name  # bob's open
    assert not any("alice" in p.name for p in (root / "keys").iterdir())
    assert os.listdir(root / "keys")


def test_verify_without_the_key_checks_the_rest_and_says_what_it_skipped(tmp_path):
    root, toks = tmp_path / "s", tokens(96, seed=45)
    with open_store(root, IDENTITY, chunk_tokens=32, key=KEY) as store:
        info = store.save("s", toks, caches_for(toks), tenant="alice")
        chunks = {r.hash for r in store.admin.manifest(info.snapshot_id).all_chunks}
    with open_store(root, admin=True) as blind:
        assert blind.verify() == []  # index, ledger, packs, sizes: no key needed
        deep = blind.verify(deep=True)
        assert {f.kind for f in deep} == {"not-checked"} and {f.where for f in deep} == {f"chunk {h}" for h in chunks}
        assert all("need the store's key" in f.detail for f in deep)
        assert blind.admin.bad_chunks() == []  # nothing was marked bad for want of a key
    with open_store(root, IDENTITY, chunk_tokens=32, key=KEY) as store:
        assert store.verify(deep=True) == []


def test_a_recompressed_sealed_chunk_stays_sealed(tmp_path):
    toks = tokens(96, seed=46)
    blocks = plaintext_blocks(caches_for(toks))
    with open_store(tmp_path / "s", IDENTITY, chunk_tokens=32, key=KEY) as store:
        info = store.save("s", toks, caches_for(toks))
        for r in store.admin.manifest(info.snapshot_id).all_chunks:
            assert store.admin.rewrite_chunk(r.hash, "zstd") is not None
        store.gc(dry_run=False)
        for r in store.admin.manifest(info.snapshot_id).all_chunks:  # each recompressed copy sealed again
            path, offset, _length = chunk_file(store, r.hash)
            with open(path, "rb") as f:
                f.seek(offset)
                assert f.read(len(SEAL_MAGIC)) == SEAL_MAGIC
            assert store.admin.chunk_info(r.hash).encoding == "zstd"
        assert leaks(pack_bytes(tmp_path / "s"), blocks) == 0
        assert bits_of(store.restore("s").caches) == bits_of(caches_for(toks))
        assert store.verify(deep=True) == []


def test_a_key_forgotten_by_another_handle_is_gone_for_this_one_too(tmp_path):
    toks = tokens(64, seed=47)
    with open_store(tmp_path / "s", IDENTITY, chunk_tokens=32, key=KEY) as store:
        store.save("s", toks, caches_for(toks), tenant="alice")
        kid_before = set(store._ctx.keys.key_ids())
        os.unlink(tmp_path / "s" / "keys" / kid_before.pop())  # as another process's forget_tenant does
        with pytest.raises(CorruptData, match="holds no data key .* forgotten"):
            store.restore("s", tenant="alice")
        store.save("t", toks, caches_for(toks), tenant="alice")  # a fresh key, never the destroyed one
        assert bits_of(store.restore("t", tenant="alice").caches) == bits_of(caches_for(toks))
