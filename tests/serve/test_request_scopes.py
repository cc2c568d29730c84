"""The tenant of a prompt-cache call on mlx-lm's generation thread (``request_scopes.py``) and the keys file.

The rule that must hold for every interleaving: an insert is stored under a scope only when every in-flight request
its tokens belong to has that scope; otherwise it is stored nowhere. Property-tested over random prompts, scopes
and inserts (segment ends: prefixes of a prompt; finished rows: a prompt plus generated tokens)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.errors import KvShelfError
from kvshelf.mlx_lm.serve.request_context import ApiKeys, RequestContexts, RequestRejected
from kvshelf.mlx_lm.serve.request_scopes import RequestScopes

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=6)
requests = st.lists(st.tuples(st.sampled_from(["", "\x1et:a", "\x1et:b"]), prompts), min_size=1, max_size=6)


@settings(max_examples=300)
@given(requests, st.data())
def test_an_insert_is_stored_only_under_the_one_scope_of_every_request_it_belongs_to(reqs, data):
    scopes = RequestScopes()
    for scope, prompt in reqs:
        scopes.announce(scope)
        assert scopes.take(prompt) == scope
    i = data.draw(st.integers(0, len(reqs) - 1))
    base = reqs[i][1]
    cut = data.draw(st.integers(1, len(base)))
    extra = data.draw(st.lists(st.integers(0, 3), max_size=3))
    tokens = base[:cut] + (extra if cut == len(base) else [])
    owners = {s for s, p in reqs if (len(tokens) >= len(p) and tokens[:len(p)] == p)
              or (len(tokens) < len(p) and p[:len(tokens)] == tokens)}
    got = scopes.scope_of(tokens)
    assert owners  # the request it came from matches
    assert got == (owners.pop() if len(owners) == 1 else None)


def test_a_finished_row_ends_its_request_and_later_inserts_are_not_guessed():
    scopes = RequestScopes()
    scopes.announce("\x1et:a")
    scopes.take([1, 2, 3])
    assert scopes.scope_of([1, 2]) == "\x1et:a"  # a segment end
    assert scopes.scope_of([1, 2, 3, 9]) == "\x1et:a"  # the finished row
    assert scopes.scope_of([1, 2, 3, 9]) is None  # nothing in flight any more, and tenants are in play
    assert scopes.ambiguous == 1


def test_without_tenants_an_unmatched_insert_is_the_default_scope_as_before():
    scopes = RequestScopes()
    scopes.take([5, 6])
    assert scopes.scope_of([7, 8]) == ""


def test_the_fetch_takes_the_announced_scope_once():
    scopes = RequestScopes()
    scopes.announce("\x1et:a")
    assert scopes.take([1]) == "\x1et:a"
    assert scopes.take([2]) == ""  # a fetch nobody announced (the library use) is the default tenant's


def test_keys_file_lines_and_json(tmp_path):
    lines = tmp_path / "keys"
    lines.write_text("# comment\nk1 alice 1G\nk2 bob\n\n")
    keys = ApiKeys.read(str(lines), lambda t: 1 << 30 if t == "1G" else int(t))
    assert keys.find("k1").tenant == "alice" and keys.find("k1").max_bytes == 1 << 30
    assert keys.find("k2").tenant == "bob" and keys.find("nope") is None
    assert keys.tenants() == {"alice": 1 << 30, "bob": None}
    js = tmp_path / "keys.json"
    js.write_text('{"k3": "carol", "k4": {"tenant": "dan", "max_bytes": 5}}')
    keys = ApiKeys.read(str(js))
    assert keys.find("k3").tenant == "carol" and keys.find("k4").max_bytes == 5


@pytest.mark.parametrize("text", ["secret-key-123\n", "secret-key-123 a b c\n", '{"secret-key-123": 5}',
                                  "secret-key-123 bad\x01tenant\n", "{not json"])
def test_a_bad_keys_file_is_one_error_that_never_shows_a_key(tmp_path, text):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KvShelfError) as info:
        ApiKeys.read(str(path))
    assert "secret-key-123" not in str(info.value) and str(path) in str(info.value)


def test_headers_and_salt_rules(tmp_path):
    path = tmp_path / "keys"
    path.write_text("k1 alice\n")
    contexts = RequestContexts(ApiKeys.read(str(path)))
    assert contexts.from_headers({"Authorization": "Bearer k1"}).tenant == "alice"
    assert contexts.from_headers({"x-api-key": "k1"}).tenant == "alice"
    for headers, status in (({}, 401), ({"Authorization": "Basic k1"}, 401), ({"Authorization": "Bearer k2"}, 401),
                            ({"Authorization": "Bearer k1", "X-Kvshelf-Tenant": "bob"}, 403)):
        with pytest.raises(RequestRejected) as info:
            contexts.from_headers(headers)
        assert info.value.status == status and "k1" not in info.value.message
    ctx = contexts.from_headers({"Authorization": "Bearer k1"})
    salted = contexts.with_body(ctx, {"cache_salt": "s"})
    assert salted.tenant == "alice" and salted.scope not in ("", ctx.scope)
    assert RequestContexts().from_headers({"X-Kvshelf-Tenant": "carol"}).tenant == "carol"
