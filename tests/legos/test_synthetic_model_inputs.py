"""The stand-in model of the README and the demo refuses token ids outside its vocabulary.

Why: the embedding lookup is a gather with no bounds check, so an id past the vocabulary read past the end of the
embedding table (the README's snippet once did, with ids up to 599 for a 256-token vocabulary, and crashed with a
segmentation fault in a CI run; valgrind showed the out-of-bounds read). A clear ``CacheRangeError`` names the range instead."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvshelf.errors import CacheRangeError, KvShelfError
from kvshelf.latent_legos import KvScheme, SyntheticMLAModel


@pytest.mark.parametrize("bad", [256, 599, -1])
def test_token_ids_outside_the_vocabulary_are_refused(bad):
    model = SyntheticMLAModel(num_layers=2, seed=0)
    caches = model.make_caches(KvScheme.bf16())
    with pytest.raises(CacheRangeError, match=r"\[0, 256\)") as err:
        model(mx.array([[1, 2, bad]], dtype=mx.int32), caches)
    assert isinstance(err.value, KvShelfError)
    assert all(c.offset == 0 for c in caches)  # refused before any cache grew


def test_the_whole_vocabulary_is_accepted():
    model = SyntheticMLAModel(num_layers=2, seed=0)
    caches = model.make_caches(KvScheme.bf16())
    logits = model(mx.array([[0, 128, 255]], dtype=mx.int32), caches)
    assert logits.shape == (1, 3, 256) and caches[0].offset == 3
