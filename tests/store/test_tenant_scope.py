"""Tenant scopes inside namespaces (``kvshelf.store.identity``): the rule every tier's isolation rests on.

Two different (tenant, salt) pairs must never share a scope, a scope must name its tenant back, and the default
tenant without a salt must leave a namespace exactly as it was (stores written before tenants keep working)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvshelf.store import base_namespace, scoped_namespace, tenant_of, tenant_scope, tenant_token

texts = st.text(max_size=80)
salts = st.none() | st.text(max_size=300)
plain_namespaces = st.text(max_size=40).filter(lambda s: "\x1e" not in s)


@given(texts, salts, texts, salts)
def test_different_tenant_or_salt_never_share_a_scope(t1, s1, t2, s2):
    if (t1, s1) != (t2, s2):
        assert tenant_scope(t1, s1) != tenant_scope(t2, s2)


@given(plain_namespaces, texts, salts)
def test_a_scoped_namespace_names_its_tenant_and_its_base(ns, tenant, salt):
    scoped = scoped_namespace(ns, tenant, salt)
    assert tenant_of(scoped) == tenant_token(tenant)
    assert base_namespace(scoped) == ns


@given(plain_namespaces)
def test_the_default_tenant_without_salt_changes_nothing(ns):
    assert scoped_namespace(ns) == ns
    assert tenant_of(ns) == ""


def test_the_default_tenant_with_a_salt_is_its_own_scope():
    assert scoped_namespace("", "", "s") != "" and tenant_of(scoped_namespace("", "", "s")) == ""
    assert tenant_scope("", "a") != tenant_scope("", "b")


def test_long_or_unprintable_tenants_become_digests():
    assert tenant_token("alice") == "alice"
    for odd in ("x" * 65, "a\nb", "~alice"):
        token = tenant_token(odd)
        assert token.startswith("~") and len(token) == 33
