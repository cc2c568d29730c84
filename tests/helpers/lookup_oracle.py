"""Small stores for ``lookup`` and its brute-force oracle (API.md's usable-prefix rule over every stored snapshot).

Shared by the local lookup test (``tests/store/test_store_lookup_oracle.py``) and the shared tier's
(``tests/remote/test_remote_lookup.py``): the same snapshots, caches and rule on one host and across two.
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import strategies as st
from store_cases import RingCache, ring_provider

from kvshelf import Identity
from kvshelf.latent_legos import LatentGeometry, MLACache

GEOMETRY = LatentGeometry(kv_lora_rank=8, rope_head_dim=8)
IDENTITY = Identity("oracle-model")


PROVIDER = ring_provider("test-oracle-provider-v1")


def caches(n: int, trimmable: bool, floor: int) -> list:
    c = (MLACache if trimmable else RingCache)(GEOMETRY)
    c.append_latent(mx.zeros((1, n, 8)), mx.zeros((1, n, 8)), None)
    c.minimum_reusable_offset = floor
    return [c]


def oracle(snapshots, prompt) -> int:
    """API.md: p = min(lcp, len(P) - 1); usable iff p > 0, p >= floor, and p == len(E) or E is trimmable."""
    best = 0
    for tokens, trimmable, floor in snapshots:
        lcp = next((i for i, (a, b) in enumerate(zip(tokens, prompt)) if a != b), min(len(tokens), len(prompt)))
        p = min(lcp, len(prompt) - 1)
        if p > 0 and p >= floor and (p == len(tokens) or trimmable):
            best = max(best, p)
    return best


# A tiny alphabet and a shared stem make long shared prefixes (many boundaries deep) the rule, not the exception.
STEM = [5, 6, 7, 8] * 12
token = st.integers(0, 2)
snapshot = st.tuples(st.integers(0, len(STEM)), st.lists(token, min_size=0, max_size=40), st.booleans(),
                     st.integers(0, 100))


@st.composite
def stores(draw):
    snaps = []
    for stem, tail, trimmable, floor_seed in draw(st.lists(snapshot, min_size=1, max_size=7)):
        tokens = STEM[:stem] + tail
        if not tokens:
            tokens = [1]
        floor = floor_seed % (len(tokens) + 1) if floor_seed % 3 == 0 else 0
        snaps.append((tokens, trimmable, floor))
    base = draw(st.sampled_from(snaps))[0]
    cut = draw(st.integers(0, len(base) + 2))
    prompt = base[:cut] + draw(st.lists(token, min_size=0, max_size=20))
    return snaps, prompt
