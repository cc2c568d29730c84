"""Prefix records written incrementally (issue 12): a re-save of a grown session writes only its new boundaries, and
whatever sequence of saves, trims, rewrites and deletes a few sessions go through, the prefix table stays exactly what
a from-scratch computation over the current sessions gives (``tests/helpers/prefix_oracle.py``), with ``lookup``
agreeing with a brute-force longest usable prefix. Work is counted through ``records.counting()``, never timed."""

from __future__ import annotations

import tempfile

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefix_oracle import actual, brute_force, current, expected
from store_cases import flip_chunk_byte

from kvshelf import Identity, open_store
from kvshelf.errors import CorruptData
from kvshelf.latent_legos import LatentGeometry, MLACache
from kvshelf.store.prefix import records
from kvshelf.store.prefix.hashing import positions

GEOMETRY = LatentGeometry(kv_lora_rank=8, rope_head_dim=8)
IDENTITY = Identity("incremental-prefix-model")


def caches(n: int, seed: int = 0) -> list:
    c = MLACache(GEOMETRY)
    rng = np.random.default_rng(seed)
    c.append_latent(mx.array(rng.standard_normal((1, n, 8)).astype(np.float32)),
                    mx.array(rng.standard_normal((1, n, 8)).astype(np.float32)), None)
    return [c]


def open_shelf(path, **options):
    options.setdefault("chunk_tokens", 64)
    return open_store(path, identity=IDENTITY, **options)


def assert_table_exact(store, sessions) -> None:
    assert actual(store) == expected(IDENTITY.key, sessions)


def test_resaving_a_grown_session_writes_only_its_new_boundaries(tmp_path):
    """T=4096 grown by 256: the second commit touches O(new boundaries) records (the snapshot-tagged table deleted
    271 and wrote 287, ~560), and exactly the records by which the table changed."""
    toks = [int(t) for t in np.random.default_rng(1).integers(0, 50_000, size=4096 + 256)]
    with open_shelf(tmp_path / "s") as store:
        store.save("chat", toks[:4096], caches(4096))
        before, _ = actual(store)
        with records.counting() as work:
            info = store.save("chat", toks, caches(4096 + 256))
        after, heads = actual(store)
        assert work["put"] + work["delete"] <= 16 + 256 // 16 + 4, work
        assert (work["put"], work["delete"]) == (sum((after - before).values()), sum((before - after).values()))
        assert work["head"] == 1 and list(heads.values()) == [bytes.fromhex(info.snapshot_id)]
        assert_table_exact(store, {("chat", ""): (toks, info.snapshot_id)})
        hit = store.lookup(toks[:4200] + [7])
        assert (hit.session_id, hit.length, hit.snapshot_id) == ("chat", 4200, info.snapshot_id)
        assert store.verify() == []


def test_a_chat_saved_every_turn_costs_its_new_boundaries_per_turn(tmp_path):
    """32 turns of 256 tokens, saved after each (T up to 8192): every turn touches at most 256/16 + 2 records, where
    the snapshot-tagged table rewrote all of them (``pytest -s -k every_turn`` prints both totals)."""
    toks = [int(t) for t in np.random.default_rng(2).integers(0, 50_000, size=32 * 256)]
    total = snapshot_tagged = 0
    with open_shelf(tmp_path / "s") as store:
        for turn in range(1, 33):
            n = turn * 256
            with records.counting() as work:
                info = store.save("chat", toks[:n], caches(n, seed=turn))
            assert work["put"] + work["delete"] <= (256 // 16 + 2 if turn > 1 else len(positions(n))), (turn, work)
            total += work["put"] + work["delete"]
            snapshot_tagged += len(positions(n)) + (len(positions(n - 256)) if turn > 1 else 0)
        assert_table_exact(store, {("chat", ""): (toks, info.snapshot_id)})
    print(f"\n32 turns x 256 tokens: {total} prefix-record writes+deletes (snapshot-tagged table: {snapshot_tagged})")
    assert total <= 32 * (256 // 16 + 2) + 15


def test_an_identical_resave_writes_no_prefix_record_and_moves_the_head(tmp_path):
    toks = list(range(1, 200))
    with open_shelf(tmp_path / "s") as store:
        store.save("a", toks, caches(len(toks)))
        with records.counting() as work:
            info = store.save("a", toks, caches(len(toks), seed=1))
        assert (work["put"], work["delete"], work["head"]) == (0, 0, 1)
        assert_table_exact(store, {("a", ""): (toks, info.snapshot_id)})
        assert store.lookup(toks + [0]).snapshot_id == info.snapshot_id
        assert store.verify() == []


def test_every_path_that_removes_a_head_removes_its_records(tmp_path):
    """delete, eviction (budget) and quarantine (a damaged chunk met on restore) leave the table exact for the
    sessions that remain, and a lookup never meets the removed ones."""
    shared = list(range(1, 81))
    with open_shelf(tmp_path / "s", chunk_tokens=16) as store:
        infos = {name: store.save(name, shared + [1000 + i] * 20, caches(100, seed=i))
                 for i, name in enumerate(["a", "b", "c", "d"])}
        store.delete("a")
        assert_table_exact(store, current(store))
        victim = store.admin.manifest(infos["b"].snapshot_id).chunks[-1].hash
        flip_chunk_byte(store, victim)
        with pytest.raises(CorruptData):
            store.restore("b")  # the damaged chunk quarantines b
        assert {s.session_id for s in store.sessions()} == {"c", "d"}
        assert_table_exact(store, current(store))
        assert store.lookup(shared + [1001] * 20).session_id != "b"
    with open_shelf(tmp_path / "s", chunk_tokens=16, max_bytes=1000) as store:  # over budget: c and d are evicted
        info = store.save("e", [5, 6, 7], caches(3))
        assert [s.session_id for s in store.sessions()] == ["e"]
        assert_table_exact(store, {("e", ""): ([5, 6, 7], info.snapshot_id)})
        assert store.lookup(shared + [1002] * 20) is None
        assert [f.kind for f in store.verify()] == ["quarantined"]


# --- any sequence of saves ------------------------------------------------------------------------------------------
SESSIONS = [("s0", ""), ("s1", ""), ("s2", "tenant")]
STEM = [3, 1, 4, 1, 5] * 8  # a shared stem: sessions share long prefixes and many boundaries
tok = st.integers(0, 3)
op = st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 2), st.lists(tok, min_size=1, max_size=40)),
    st.tuples(st.just("trim_regrow"), st.integers(0, 2), st.integers(1, 40), st.lists(tok, max_size=40)),
    st.tuples(st.just("rewrite_last"), st.integers(0, 2), st.integers(1, 20), st.integers(1, 3)),
    st.tuples(st.just("fresh"), st.integers(0, 2), st.integers(0, len(STEM)), st.lists(tok, max_size=50)),
    st.tuples(st.just("resave"), st.integers(0, 2)),
    st.tuples(st.just("delete"), st.integers(0, 2)),
)


def apply(op, toks: list[int] | None) -> list[int] | None:
    """The tokens a session holds after ``op`` (None: deleted / absent)."""
    kind, _who, *args = op
    base = toks if toks is not None else STEM[:20]
    if kind == "grow":
        return base + args[0]
    if kind == "trim_regrow":
        out = base[:max(0, len(base) - args[0])] + args[1]
        return out or [9]
    if kind == "rewrite_last":  # the last window rewritten in place, same length (a rolled-back speculative round)
        k = min(args[0], len(base))
        return base[:len(base) - k] + [(t + args[1]) % 4 for t in base[len(base) - k:]]
    if kind == "fresh":
        return (STEM[:args[0]] + args[1]) or [9]
    if kind == "resave":
        return base
    return None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=8), probes=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 90),
                                                                         st.lists(tok, max_size=6)), max_size=4))
def test_any_sequence_of_saves_leaves_the_table_exactly_as_a_rebuild_computes(ops, probes):
    with tempfile.TemporaryDirectory() as root, open_shelf(root + "/s", chunk_tokens=32) as store:
        model: dict[tuple[str, str], tuple[list[int], str]] = {}
        for step, o in enumerate(ops):
            who = SESSIONS[o[1]]
            toks = apply(o, model.get(who, (None,))[0])
            if toks is None:
                if who in model:
                    store.delete(who[0], namespace=who[1])
                    del model[who]
            else:
                info = store.save(who[0], toks, caches(len(toks), seed=step), namespace=who[1])
                model[who] = (toks, info.snapshot_id)
            assert_table_exact(store, model)
        for which, cut, tail in probes:
            for ns in ("", "tenant"):
                mine = {k: v for k, v in model.items() if k[1] == ns}
                source = mine.get(SESSIONS[which], next(iter(mine.values()), (STEM, "")))[0]
                prompt = source[:cut] + tail
                hit = store.lookup(prompt, namespace=ns)
                want = brute_force(mine, prompt) if len(prompt) >= 2 else 0
                assert (hit.length if hit else 0) == want, (prompt, hit, want)
                if hit:
                    assert model[(hit.session_id, ns)][1] == hit.snapshot_id
        assert store.verify() == []
