"""Authentication and TLS pass straight through to redis-py: an ACL user confined to kvshelf's key prefix (so a
server shared with other applications is safe), a wrong password (a miss, saves unaffected), and ``rediss://``."""

from __future__ import annotations

from redis_servers import RedisServer, make_certs
from test_remote_faults import bits_of, caches_for, host, published, tokens


def test_acl_user_confined_to_the_prefix(tmp_path):
    acl = ["--user", "default", "off", "--user", "admin", "on", ">root-pw", "~*", "&*", "+@all",
           "--user", "kv", "on", ">kv-pw", "~kvshelf:*", "+@all", "-@dangerous", "+info"]
    server = RedisServer(acl, cli_args=["--user", "admin", "--pass", "root-pw"])
    try:
        server.cli("SET", "other-app:secret", "42")
        url = f"redis://kv:kv-pw@127.0.0.1:{server.port}/0"
        toks = tokens(120, seed=50)
        with host(tmp_path / "a", url) as a, host(tmp_path / "b", url) as b:
            published(a, toks)
            assert a.tier.counters["published"] == 1
            r = b.restore_prefix(toks + [1])
            assert r.length == 120 and bits_of(r.caches) == bits_of(caches_for(toks))
            assert "***" in a.tier.stats()["remote"] and "kv-pw" not in a.tier.stats()["remote"]
        assert server.cli("GET", "other-app:secret") == "42"
        with host(tmp_path / "c", f"redis://kv:wrong@127.0.0.1:{server.port}/0") as c:
            c.save("s", toks, caches_for(toks))  # local save fine; the publish fails and is counted
            assert c.tier.flush(30) and c.tier.counters["publish_failed"] == 1
            assert c.restore_prefix(toks + [1]).length == 120  # served locally
            assert c.lookup([7, 7, 7]) is None and c.tier.counters["lookup_errors"] == 1
    finally:
        server.close()


def test_tls_rediss(tmp_path):
    certs = make_certs(str(tmp_path))
    server = RedisServer(tls_dir=certs)
    try:
        url = f"rediss://127.0.0.1:{server.port}/0"
        options = {"ssl_ca_certs": f"{certs}/ca.crt"}
        toks = tokens(100, seed=51)
        with host(tmp_path / "a", url, **options) as a, host(tmp_path / "b", url, **options) as b:
            published(a, toks)
            assert a.tier.counters["published"] == 1
            r = b.restore_prefix(toks + [1])
            assert r.length == 100 and bits_of(r.caches) == bits_of(caches_for(toks))
        with host(tmp_path / "c", f"redis://127.0.0.1:{server.port}/0") as plain:  # no TLS: refused, a miss
            assert plain.lookup(toks + [1]) is None and plain.tier.counters["lookup_errors"] == 1
    finally:
        server.close()
