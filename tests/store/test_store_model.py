"""Model-based test: random save / restore / lookup / delete / gc / reopen sequences against a dict of sessions.

After every step ``verify()`` finds nothing; restores are bit-exact to what the model says was saved; lookups give the
longest usable prefix a brute-force scan of the model finds.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from store_cases import IDENTITY

from kvshelf import open_store
from kvshelf.errors import SnapshotNotFound
from kvshelf.latent_legos import LatentGeometry, MLACache

G = LatentGeometry(kv_lora_rank=16, rope_head_dim=8)
FAMILIES = [np.random.default_rng(f).integers(0, 1000, size=80).tolist() for f in range(3)]


def tokens_of(family: int, split: int, tail_seed: int, n: int) -> list[int]:
    tail = np.random.default_rng(1000 + tail_seed).integers(1000, 2000, size=80).tolist()
    return (FAMILIES[family][:split] + tail)[:n]


def caches_for(tokens: list[int]) -> list[MLACache]:
    """Tensors are a pure function of (token, position): equal prefixes give equal (shared) chunks."""
    t = np.asarray(tokens, dtype=np.float32)[:, None]
    pos = np.arange(len(tokens), dtype=np.float32)[:, None]
    out = []
    for layer in range(2):
        latent = np.sin(t * 0.001 + np.arange(16)[None, :] * 0.1 + pos * 0.01 + layer)[None].astype(np.float32)
        rope = np.cos(t * 0.002 + np.arange(8)[None, :] * 0.3 + pos * 0.02 + layer)[None].astype(np.float32)
        c = MLACache(G)
        c.append_latent(mx.array(latent), mx.array(rope), None)
        out.append(c)
    return out


def state_bits(caches) -> list[bytes]:
    return [np.array(a).tobytes() for c in caches for a in c.state] + [bytes(str([c.offset for c in caches]), "ascii")]


SESSIONS = st.sampled_from(["s0", "s1", "s2", "s3"])
NAMESPACES = st.sampled_from(["", "tenant"])
SPEC = st.tuples(st.integers(0, 2), st.integers(0, 80), st.integers(0, 3), st.integers(1, 70))


class StoreModel(RuleBasedStateMachine):
    @initialize()
    def open(self):
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.store = open_store(self.tmp.name, identity=IDENTITY, chunk_tokens=8)
        self.model: dict[tuple[str, str], list[int]] = {}

    @rule(session=SESSIONS, namespace=NAMESPACES, spec=SPEC)
    def save(self, session, namespace, spec):
        tokens = tokens_of(*spec)
        info = self.store.save(session, tokens, caches_for(tokens), namespace=namespace)
        assert info.length == len(tokens)
        self.model[(session, namespace)] = tokens

    @rule(session=SESSIONS, namespace=NAMESPACES)
    def restore(self, session, namespace):
        if (session, namespace) not in self.model:
            try:
                self.store.restore(session, namespace=namespace)
            except SnapshotNotFound:
                return
            raise AssertionError("restored a session the model does not have")
        r = self.store.restore(session, namespace=namespace)
        assert r.tokens == self.model[(session, namespace)]
        assert state_bits(r.caches) == state_bits(caches_for(r.tokens))

    @rule(namespace=NAMESPACES, spec=SPEC, extra=st.integers(0, 3))
    def lookup(self, namespace, spec, extra):
        prompt = tokens_of(*spec) + [5000 + extra]
        expected = 0
        for (_, ns), tokens in self.model.items():
            if ns != namespace:
                continue
            n = min(len(tokens), len(prompt))
            lcp = next((i for i in range(n) if tokens[i] != prompt[i]), n)
            expected = max(expected, min(lcp, len(prompt) - 1))
        hit = self.store.lookup(prompt, namespace=namespace)
        assert (hit.length if hit else 0) == expected
        if hit:
            assert self.model[(hit.session_id, namespace)][: hit.length] == prompt[: hit.length]
            r = self.store.restore_prefix(prompt, namespace=namespace)
            assert r.length == expected and state_bits(r.caches) == state_bits(caches_for(prompt[:expected]))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.delete(*key)
        del self.model[key]

    @rule()
    def gc(self):
        report = self.store.gc(dry_run=False)
        assert report.orphan_objects == [] and report.orphan_manifests == []

    @rule()
    def reopen(self):
        self.store.close()
        self.store = open_store(self.tmp.name, identity=IDENTITY, chunk_tokens=8)

    @invariant()
    def consistent(self):
        if hasattr(self, "store"):
            assert self.store.verify() == []
            assert {(s.session_id, s.namespace) for s in self.store.sessions()} == set(self.model)

    def teardown(self):
        if hasattr(self, "store"):
            assert self.store.verify(deep=True) == []
            self.store.close()
            self.tmp.cleanup()


StoreModel.TestCase.settings = settings(max_examples=12, stateful_step_count=15, deadline=None)
test_store_model = StoreModel.TestCase
