"""Generation checkpoints in the store: their own namespace, the longest whole checkpoint of a key for exactly its
prompt, older ones deleted once a newer one is durable, dropped on completion; damaged ones quarantined (the next
longest is used); the continuation key is a pure function of its fields.
"""

from __future__ import annotations

import pytest
from codec_cases import CASES_BY_ID
from hypothesis import given
from hypothesis import strategies as st
from store_cases import flip_chunk_byte, open_test_store, same_caches, session, token_ids

from kvshelf.errors import InvalidCacheState, WrongArgumentType
from kvshelf.store import continuation_key
from kvshelf.store.generations import NAMESPACE_PREFIX

MLA = CASES_BY_ID["mla-f32-nodsa"]
PROMPT = 12
KEY = "a" * 64


def checkpoint(store, generated: int, key: str = KEY, seed: int = 0, prompt_length: int = PROMPT, **kw):
    n = prompt_length + generated
    tokens = token_ids(n, seed)
    caches = session(MLA, lengths=(n,), seed=seed)
    store.save_generation_checkpoint(key, tokens, caches, prompt_length=prompt_length,
                                     pending_token=kw.get("pending", 7), sampler_state=kw.get("state", b"\x01" * 8))
    return tokens, caches


def test_the_longest_checkpoint_of_the_key_for_this_prompt_is_restored_whole(tmp_path):
    with open_test_store(tmp_path / "s") as store:
        tokens, caches = checkpoint(store, 8, pending=42, state=b"12345678")
        found = store.find_generation_checkpoint(KEY, tokens[:PROMPT])
        assert found.tokens == tokens and found.generated == tokens[PROMPT:]
        assert (found.prompt_length, found.pending_token, found.sampler_state) == (PROMPT, 42, b"12345678")
        same_caches(found.caches, caches)
        assert store.find_generation_checkpoint("b" * 64, tokens[:PROMPT]) is None  # another key
        assert store.find_generation_checkpoint(KEY, tokens[:PROMPT - 1]) is None  # another prompt length
        assert store.find_generation_checkpoint(KEY, [t + 1 for t in tokens[:PROMPT]]) is None  # other tokens
        assert store.lookup(tokens) is None  # never an ordinary prefix of the default namespace
        assert [s.namespace for s in store.sessions()] == [NAMESPACE_PREFIX + KEY]


def test_a_newer_checkpoint_replaces_older_ones_only_once_durable_and_completion_drops_all(tmp_path):
    with open_test_store(tmp_path / "s") as store:
        checkpoint(store, 4)
        tokens, _ = checkpoint(store, 8)
        assert [s.length for s in store.sessions()] == [PROMPT + 8]
        fut = store.save_generation_checkpoint(KEY, token_ids(PROMPT + 12), session(MLA, lengths=(PROMPT + 12,)),
                                               prompt_length=PROMPT, pending_token=1, sampler_state=None,
                                               background=True)
        assert fut.result(timeout=60).length == PROMPT + 12
        assert [s.length for s in store.sessions()] == [PROMPT + 12]
        assert store.find_generation_checkpoint(KEY, tokens[:PROMPT]).sampler_state is None
        assert store.drop_generation_checkpoints(KEY) == 1
        assert store.sessions() == [] and store.find_generation_checkpoint(KEY, tokens[:PROMPT]) is None
        assert store.drop_generation_checkpoints(KEY) == 0


def test_a_damaged_checkpoint_is_quarantined_and_the_next_longest_is_used(tmp_path):
    with open_test_store(tmp_path / "s") as store:
        tokens, _ = checkpoint(store, 4)
        # a second, longer one from "another process" on the same continuation: made without deleting the first
        longer = store.save(f"g{8:010d}-p{PROMPT}-t9-s-{'0' * 12}", tokens + token_ids(4, 5),
                            session(MLA, lengths=(PROMPT + 8,), seed=3), namespace=NAMESPACE_PREFIX + KEY)
        flip_chunk_byte(store, store.admin.manifest(longer.snapshot_id).chunks[-1].hash)
        found = store.find_generation_checkpoint(KEY, tokens[:PROMPT])
        assert found is not None and len(found.generated) == 4
        assert any(f.kind == "quarantined" for f in store.verify())


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"prompt_length": 0}, InvalidCacheState), ({"prompt_length": PROMPT + 4}, InvalidCacheState),
    ({"pending_token": -1}, InvalidCacheState), ({"sampler_state": "x"}, WrongArgumentType),
    ({"sampler_state": b"x" * 65}, InvalidCacheState), ({"key": "no spaces"}, InvalidCacheState),
    ({"key": 5}, WrongArgumentType)])
def test_bad_arguments_are_refused_and_nothing_is_written(tmp_path, kwargs, error):
    args = {"key": KEY, "prompt_length": PROMPT, "pending_token": 1, "sampler_state": None, **kwargs}
    key = args.pop("key")
    with open_test_store(tmp_path / "s") as store:
        with pytest.raises(error):
            store.save_generation_checkpoint(key, token_ids(PROMPT + 4), session(MLA, lengths=(PROMPT + 4,)), **args)
        assert store.sessions() == []


fields = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(),
                                                         st.lists(st.integers(), max_size=5), st.none()), max_size=6)


@given(fields)
def test_the_continuation_key_is_a_pure_function_of_the_fields_not_of_their_order(doc):
    again = dict(reversed(list(doc.items())))
    assert continuation_key(doc) == continuation_key(again)
    assert len(continuation_key(doc)) == 64
    changed = dict(doc, extra_field_not_in_doc=1)
    assert continuation_key(changed) != continuation_key(doc)


def test_the_continuation_key_refuses_values_that_are_not_json():
    with pytest.raises(InvalidCacheState):
        continuation_key({"x": float("nan")})
    with pytest.raises(InvalidCacheState):
        continuation_key({"x": object()})
