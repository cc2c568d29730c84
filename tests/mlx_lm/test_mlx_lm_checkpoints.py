"""Checkpoints along the prompt (issue 22) on mlx-lm's hybrid, recurrent and sliding-window models: tiny seeded
qwen3_next (``ArraysCache`` + ``KVCache``), mamba2 (``ArraysCache`` only) and gemma3_text (``RotatingKVCache`` with a
4-token window, so the ring wraps at once, + ``KVCache``).

A 4,000-token session is prefilled with ``kvshelf.mlx_lm.prefill(every=1024)`` and saved with its checkpoints;
prompts that diverge from it at 1,500, 2,100 and 3,900 tokens restore the checkpoint at 1,024, 2,048 and 3,072
and continue greedily bit-identical (tokens and logits) to a fresh prefill of the same prompt; one diverging at 900
gets None. Storage: the checkpoints of the qwen3_next session add exactly its recurrent state's bytes (counted, not
timed), and deleting the session removes them."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache
from mlx_lm_models import VOCAB, build, continue_greedy, same

from kvshelf import Identity, open_store
from kvshelf.mlx_lm import CheckpointCollector, prefill

LENGTH, EVERY = 4000, 1024
MODELS = ("qwen3_next", "mamba2", "gemma3_text")
DIVERGE = {900: None, 1500: 1024, 2100: 2048, 3900: 3072}


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def _session(model):
    tokens = _tokens(LENGTH, 0)
    cache = make_prompt_cache(model)
    collect = CheckpointCollector()
    assert prefill(model, tokens, cache, every=EVERY, on_checkpoint=collect) == LENGTH
    assert sorted(collect.states) == [1024, 2048, 3072]
    return tokens, cache, collect.for_store(cache, LENGTH)


def _fresh(model, prompt):
    cache = make_prompt_cache(model)
    prefill(model, prompt[:-1], cache, every=EVERY)
    return continue_greedy(model, prompt[-1], cache, 4), cache


@pytest.mark.parametrize("name", MODELS)
def test_prompts_diverging_inside_a_session_restore_its_checkpoints_and_continue_bit_identical(tmp_path, name):
    model = build(name)
    tokens, cache, checkpoints = _session(model)
    with open_store(tmp_path / "s", identity=Identity(f"tiny-{name}")) as store:
        store.save("chat", tokens, cache, checkpoints=checkpoints)
        assert [c.length for c in store.list_checkpoints("chat")] == [1024, 2048, 3072]
        assert [s.session_id for s in store.sessions()] == ["chat"]  # checkpoints are not sessions
        for at, want in DIVERGE.items():
            prompt = tokens[:at] + _tokens(100, at)
            assert prompt[at] != tokens[at] or at == LENGTH
            hit = store.lookup(prompt)
            if want is None:
                assert hit is None and store.restore_prefix(prompt) is None
                continue
            assert (hit.session_id, hit.length, hit.checkpoint) == ("chat", want, True)
            restored = store.restore_prefix(prompt)
            assert restored.length == want and restored.tokens == prompt[:want]
            caches = restored.caches
            if name == "gemma3_text":  # the ring is what mlx-lm holds after prefilling those tokens
                at_k = make_prompt_cache(model)
                prefill(model, tokens[:want], at_k, every=EVERY)
                for got, ref in zip(caches, at_k):
                    if isinstance(ref, RotatingKVCache):
                        assert (got._idx, got.keep, got.offset, got.max_size) == \
                            (ref._idx, ref.keep, ref.offset, ref.max_size)
                        assert same(got.keys, ref.keys) and same(got.values, ref.values)
            prefill(model, prompt[want:-1], caches, every=EVERY, offset=want)
            got = continue_greedy(model, prompt[-1], caches, 4)
            ref, _ = _fresh(model, prompt)
            assert got[0] == ref[0] and all(same(a, b) for a, b in zip(got[1], ref[1]))


def test_checkpoints_of_a_hybrid_session_cost_only_its_recurrent_state_and_go_with_it(tmp_path):
    model = build("qwen3_next")
    tokens, cache, checkpoints = _session(model)
    recurrent = {k: sum(a.nbytes for c in caches if isinstance(c, ArraysCache) for a in c.cache if a is not None)
                 for k, caches in checkpoints.items()}
    assert all(v > 0 for v in recurrent.values())
    with open_store(tmp_path / "s", identity=Identity("tiny-qwen3_next")) as store:
        info = store.save("chat", tokens, cache)
        before = store.counters["bytes_written"]
        for k in sorted(checkpoints):
            store.save_checkpoint("chat", tokens[:k], checkpoints[k])
        assert store.counters["bytes_written"] - before == sum(recurrent.values())
        assert store.stats()["snapshots"] == 4  # the session and its three checkpoints, all in the budget
        assert store.stats()["snapshot_bytes"] == info.bytes_written + sum(c.nbytes for c in
                                                                           store.list_checkpoints("chat"))
        assert store.verify(deep=True) == []
        store.delete("chat")
        assert (store.stats()["stored_bytes"], store.stats()["snapshots"]) == (0, 0)
        assert store.list_checkpoints("chat") == []
        assert store.lookup(tokens[:1500] + [1, 2]) is None
        assert store.verify(deep=True) == []
