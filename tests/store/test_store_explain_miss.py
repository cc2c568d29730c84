"""``Store.explain_miss``: a miss names its cause — nothing stored, another identity's prefix, below the floor, or
state that cannot be cut with a prompt that diverges before its end (what ``kvshelf serve`` counts in
``kvshelf_misses_total{reason=...}``)."""

from __future__ import annotations

from lookup_oracle import IDENTITY, PROVIDER, caches

from kvshelf import Identity, open_store

TOKENS = list(range(10, 74))  # 64 tokens


def _store(path, identity=IDENTITY):
    return open_store(path, identity=identity, provider=PROVIDER, chunk_tokens=16)


def test_an_empty_store_has_nothing_stored(tmp_path):
    with _store(tmp_path / "s") as store:
        assert store.lookup(TOKENS) is None
        assert store.explain_miss(TOKENS) == "nothing_stored"


def test_a_prompt_sharing_nothing_is_nothing_stored(tmp_path):
    with _store(tmp_path / "s") as store:
        store.save("a", TOKENS, caches(len(TOKENS), True, 0))
        prompt = [999] + TOKENS
        assert store.lookup(prompt) is None and store.explain_miss(prompt) == "nothing_stored"


def test_a_prefix_under_another_identity_is_named(tmp_path):
    with _store(tmp_path / "s", Identity("another-model")) as other:
        other.save("a", TOKENS, caches(len(TOKENS), True, 0))
    with _store(tmp_path / "s") as store:
        prompt = TOKENS[:40] + [1, 2, 3]
        assert store.lookup(prompt) is None and store.explain_miss(prompt) == "other_identity"


def test_a_shared_prefix_below_the_floor_is_named(tmp_path):
    with _store(tmp_path / "s") as store:
        store.save("a", TOKENS, caches(len(TOKENS), True, 50))  # reusable from 50 tokens on
        prompt = TOKENS[:30] + [1, 2, 3]
        assert store.lookup(prompt) is None and store.explain_miss(prompt) == "below_floor"


def test_untrimmable_state_diverging_before_its_end_is_named(tmp_path):
    with _store(tmp_path / "s") as store:
        store.save("a", TOKENS, caches(len(TOKENS), False, 0))  # recurrent / wrapped ring: exact length only
        prompt = TOKENS[:40] + [1, 2, 3]
        assert store.lookup(prompt) is None and store.explain_miss(prompt) == "not_exact_length"
        assert store.lookup(TOKENS + [5]).length == len(TOKENS)  # at its exact length it is served
