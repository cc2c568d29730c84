"""``lookup`` against a brute-force oracle: the longest usable prefix over *every* stored snapshot (API.md's rule),
on small stores whose snapshots share long prefixes and mix floors and untrimmable caches — the cases where a lookup
that only looks near the deepest shared boundary would return a shorter match than the true one."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from lookup_oracle import IDENTITY, PROVIDER, caches, oracle, stores

from kvshelf import open_store


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One store for every example (each example saves into a namespace of its own: lookups never cross them)."""
    with open_store(tmp_path_factory.mktemp("oracle") / "s", identity=IDENTITY, provider=PROVIDER,
                    chunk_tokens=64) as store:
        yield store


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=stores())
def test_lookup_finds_the_longest_usable_prefix_over_all_snapshots(shared_store, case) -> None:
    snaps, prompt = case
    store, ns = shared_store, uuid.uuid4().hex
    for i, (tokens, trimmable, floor) in enumerate(snaps):
        store.save(f"s{i}", tokens, caches(len(tokens), trimmable, floor), namespace=ns)
    want = oracle(snaps, prompt)
    for form in (prompt, np.array(prompt, dtype=np.int64)):  # lists are read lazily, arrays whole
        hit = store.lookup(form, namespace=ns)
        assert (0 if hit is None else hit.length) == want, (hit, want)
    if hit is not None:
        tokens, trimmable, floor = snaps[int(hit.session_id[1:])]
        assert tokens[:want] == prompt[:want] and want >= floor and (trimmable or want == len(tokens))
        r = store.restore_prefix(prompt, namespace=ns)
        assert r.length == want and r.caches[0].offset == want


def test_many_unusable_snapshots_around_the_prompt_do_not_hide_a_usable_one(tmp_path) -> None:
    """Forty untrimmable sessions continue a shared system prompt the same way the prompt does (so they sort right
    next to it) but diverge before their ends; one trimmable session shares only the system prompt."""
    system = list(range(100, 164))  # 64 tokens: four 16-token boundaries
    with open_store(tmp_path / "s", identity=IDENTITY, provider=PROVIDER, chunk_tokens=64) as store:
        store.save("short", system + [1] * 20, caches(84, True, 0))
        for k in range(40):
            toks = system + [7] * (10 + k % 5) + [9, k] + [3] * 30
            store.save(f"ring{k}", toks, caches(len(toks), False, 0))
        prompt = system + [7] * 16 + [8] * 40
        hit = store.lookup(prompt)
        assert (hit.session_id, hit.length) == ("short", 64)
        # and a deep untrimmable match far above the usable one (more than 4 boundaries deeper)
        deep = system + list(range(500, 700))
        store.save("deep-ring", deep, caches(len(deep), False, 0))
        hit = store.lookup(deep[:250] + [1, 2, 3])
        assert (hit.session_id, hit.length) == ("short", 64)
        assert store.lookup(deep + [1]).session_id == "deep-ring"
        assert np.array_equal(np.array(store.restore_prefix(deep[:250] + [1]).tokens), np.array(system))
