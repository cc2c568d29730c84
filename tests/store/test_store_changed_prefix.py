"""A session saved, then changed *in place* below what was stored (a rolled-back and rewritten speculative window, a
trimmed-and-regrown row, one position overwritten) and saved again, restores exactly the changed cache: no chunk of
the earlier snapshot is ever reused for bytes that changed (issue 11). Chunks are reused only by content hash, so a
changed chunk hashes to a new name; this property test drives the in-place edits a cache really makes
(``trim`` then ``update_and_fetch`` / ``append_latent``) through the same live cache object the first save captured.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from codec_cases import CASES_BY_ID, append, filled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_cases import kv, raw
from store_cases import open_test_store, token_ids

from kvshelf.latent_legos.kv import KVCache

MLA = CASES_BY_ID["mla-f32-nodsa"]


def state_bits(caches) -> list[bytes]:
    out = []
    for c in caches:
        for a in c.state:
            mx.eval(a)
            out.append(str(a.shape).encode() + raw(a[..., : c.offset, :] if a.ndim == 4 else a).tobytes())
    return out


def kv_session(n: int, seed: int) -> list:
    caches = []
    for layer in range(2):
        c = KVCache()
        c.update_and_fetch(*kv(1, n, seed * 10 + layer, heads=2, dk=8, dv=8, dtype=mx.float16))
        caches.append(c)
    return caches


def edit_kv(caches, back: int, regrow: int, seed: int) -> None:
    """Roll back ``back`` positions and write ``regrow`` new ones in their place (the same buffers)."""
    for layer, c in enumerate(caches):
        c.trim(back)
        if regrow:
            c.update_and_fetch(*kv(1, regrow, 5000 + seed * 10 + layer, heads=2, dk=8, dv=8, dtype=mx.float16))


def edit_mla(caches, back: int, regrow: int, seed: int) -> None:
    for layer, c in enumerate(caches):
        c.trim(back)
        if regrow:
            append(c, regrow, 7000 + seed * 10 + layer)


EDITS = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["kv", "mla"]), n=st.integers(1, 24), edits=EDITS, seed=st.integers(0, 50))
def test_a_prefix_changed_in_place_is_never_served_from_the_old_chunks(tmp_path_factory, kind, n, edits, seed):
    root = tmp_path_factory.mktemp("changed")
    caches = kv_session(n, seed) if kind == "kv" else [filled(MLA, lengths=(n,), seed=seed + 100 * k)
                                                       for k in range(2)]
    edit = edit_kv if kind == "kv" else edit_mla
    tokens = token_ids(n, seed)
    with open_test_store(root, chunk_tokens=4) as store:
        store.save("s", tokens, caches)
        for step, (back, regrow) in enumerate(edits):
            back = min(back, caches[0].offset)
            edit(caches, back, regrow, seed * 100 + step)
            length = caches[0].offset
            if length == 0:
                continue
            # the rewritten window gets other token ids too, as a different speculative branch would
            tokens = tokens[: length - regrow] + token_ids(regrow, 900 + seed * 100 + step) if regrow else \
                tokens[:length]
            store.save("s", tokens, caches)
            got = store.restore("s")
            assert got.tokens == tokens
            assert state_bits(got.caches) == state_bits(caches), (kind, n, edits, step)
        assert store.verify(deep=True) == []


def test_one_position_overwritten_below_the_stored_length_is_saved(tmp_path):
    caches = kv_session(16, 3)
    with open_test_store(tmp_path / "s", chunk_tokens=4) as store:
        store.save("s", token_ids(16), caches)
        for c in caches:  # position 5 rewritten in place, the length unchanged
            keys, values = (a[..., :16, :] for a in c.state)
            bumped = np.array(raw(keys))
            bumped[0, 0, 5, 0] ^= 1
            c.trim(16)
            c.update_and_fetch(mx.array(bumped).view(mx.float16), values)
        info = store.save("s", token_ids(16), caches)
        assert info.chunks_written == 1  # only the chunk holding position 5 is new
        assert state_bits(store.restore("s").caches) == state_bits(caches)
