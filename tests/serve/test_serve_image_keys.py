"""Image prompts on disk: mlx-lm 0.32's image cache keys (negative ids, from mlx-lm's own ``_make_vision``) through
the ``TieredPromptCache`` with a real store and real mlx-lm caches.

Why not through ``kvshelf serve`` with an image: mlx-lm 0.32 takes images only for models with an image processor
(``mlx_lm.processors.PROCESSORS``: Muse Spark alone), and Muse Spark's layers run custom Metal kernels
(``mlx_lm.kernels``, ``mx.fast.metal_kernel``): on a host without Metal (this Linux CPU build) plain
``mlx_lm.server`` answers an image request with ``[metal_kernel] No Metal back-end``. So the keying is tested on the
token sequences mlx-lm's server hands to ``fetch_nearest_cache`` / ``insert_cache``, which is all the prompt cache
ever sees of an image.
"""

from __future__ import annotations

import base64

import pytest
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.server import _make_vision
from mlx_lm_models import build, forward, same

from kvshelf import Identity, open_store
from kvshelf.mlx_lm import TieredPromptCache
from kvshelf.mlx_lm.serve.image_keys import RESERVED, storable_key, trusted_length

KEY = ("tiny-llama", None, None)
PATCH = 9  # the image patch token of the prompt (mlx-lm's processor.image_token)
TEXT = [5, 17, 42, 8, 77, 3, 61, 29, 90, 11, 13, 21, 34, 55, 2, 4, 6]


def url(seed: int) -> str:
    """A data URL: mlx-lm's image id is the SHA-256 of it, i.e. of the image's bytes."""
    return "data:image/png;base64," + base64.b64encode(bytes([seed]) * 64).decode()


def prompt(*images: int, patches: int = 6) -> tuple[list[int], list[int]]:
    """(prompt, mlx-lm's cache key): the text, then each image's patch tokens followed by a few words."""
    tokens = list(TEXT)
    for i, _seed in enumerate(images):
        tokens += [PATCH] * patches + [20 + i, 30 + i, 40 + i]
    vision = _make_vision(tokens, urls=[url(s) for s in images], pixel_values=[], token_id=PATCH)
    return tokens, vision.cache_key


@pytest.fixture(scope="module")
def llama():
    return build("llama")


def filled(model, tokens):
    cache = make_prompt_cache(model)
    forward(model, tokens, cache)
    return cache


def tiered(store):
    return TieredPromptCache(LRUPromptCache(max_size=10), store)


def test_the_mapping_is_one_to_one_and_keeps_text():
    tokens, key = prompt(1, 2)
    mapped = storable_key(key)
    assert mapped[: len(TEXT)] == TEXT and all(0 <= t < 2**31 for t in mapped)
    assert [t >= RESERVED for t in mapped] == [t < 0 for t in key]  # images where they were, text below RESERVED
    assert storable_key(TEXT) is TEXT  # a text prompt is not copied
    assert storable_key(prompt(2, 1)[1]) != mapped and storable_key(prompt(1, 3)[1]) != mapped
    m = -1 - key[len(TEXT)]
    assert mapped[len(TEXT)] == RESERVED + (m >> 30) and mapped[len(TEXT) + 1] == RESERVED + (m & (2**30 - 1))
    assert storable_key(prompt(1, patches=1)[1]) is None  # one patch token cannot carry a 60-bit id
    assert storable_key([*TEXT, RESERVED]) is None  # a token id in the reserved range: never mistaken for an image
    assert storable_key([3, -7, -7, -8, -8, 4]) is None  # two images adjacent: not one of mlx-lm's keys
    # a stored prefix ending after one token of an image matched half its id: cut back to the image's start
    start = len(TEXT)
    assert trusted_length(mapped, start + 1) == start and trusted_length(mapped, start + 2) == start + 2
    assert trusted_length(mapped, start) == start and trusted_length(TEXT, 5) == 5


def test_an_image_prompt_is_stored_and_restored_after_a_restart(llama, tmp_path):
    tokens, key = prompt(1)
    cache = filled(llama, tokens)
    with open_store(tmp_path / "store", identity=Identity("tiny-llama", "cfg", "tok")) as store:
        first = tiered(store)
        first.scopes.take(key)  # the request's fetch comes first on the server (its scope is recorded)
        first.insert_cache(KEY, list(key), cache)
        assert first.flush(timeout=60)
        assert first.counters["writes_done"] == 1 and first.counters["writes_skipped_unstorable"] == 0
    with open_store(tmp_path / "store", identity=Identity("tiny-llama", "cfg", "tok")) as store:
        again = tiered(store)  # a restarted server: empty RAM, the store reopened
        got, rest = again.fetch_nearest_cache(KEY, key + [7, 8])
        assert rest == [7, 8] and got[0].offset == len(key) and again.counters["disk_hits"] == 1
        # the restored cache continues exactly as the original would: an identical reply
        assert same(forward(llama, [7, 8], got), forward(llama, [7, 8], filled(llama, tokens)))


def test_another_image_or_swapped_images_never_hit_and_the_text_before_is_shared(llama, tmp_path):
    with open_store(tmp_path / "store", identity=Identity("tiny-llama", "cfg", "tok")) as store:
        writer = tiered(store)
        tokens, key = prompt(1, 2)
        writer.scopes.take(key)
        writer.insert_cache(KEY, list(key), filled(llama, tokens))
        assert writer.flush(timeout=60) and writer.counters["writes_done"] == 1
        for other in (prompt(3, 2)[1], prompt(2, 1)[1]):  # another first image; the two images swapped
            reader = tiered(store)
            got, rest = reader.fetch_nearest_cache(KEY, other)
            assert reader.counters["disk_hits"] == 1 and got[0].offset == len(TEXT)  # the text before: shared
            assert rest == other[len(TEXT):]
        reader = tiered(store)  # same first image, another second image: shared up to the second image
        other = prompt(1, 3)[1]
        got, rest = reader.fetch_nearest_cache(KEY, other)
        second = len(TEXT) + 6 + 3
        assert got[0].offset == second and rest == other[second:]
        reader = tiered(store)  # a text prompt that is the text before the image (and more) shares it too
        got, rest = reader.fetch_nearest_cache(KEY, TEXT + [70, 71])
        assert got[0].offset == len(TEXT) and rest == [70, 71]


def test_an_image_prompt_is_shared_through_the_shared_tier(llama, tmp_path):
    from redis_servers import RedisServer

    server = RedisServer()
    ident = Identity("tiny-llama", "cfg", "tok")
    try:
        tokens, key = prompt(1)
        with open_store(tmp_path / "a", identity=ident, remote=server.url) as a:
            writer = tiered(a)
            writer.scopes.take(key)
            writer.insert_cache(KEY, list(key), filled(llama, tokens))
            assert writer.flush(timeout=60) and a.tier.flush(30)
        with open_store(tmp_path / "b", identity=ident, remote=server.url) as b:  # another host: nothing local
            reader = tiered(b)
            got, rest = reader.fetch_nearest_cache(KEY, key + [7])
            assert reader.counters["remote_hits"] == 1 and got[0].offset == len(key) and rest == [7]
            assert same(forward(llama, [7], got), forward(llama, [7], filled(llama, tokens)))
            other = tiered(b)  # another image through the shared tier: only the text before it
            got, _rest = other.fetch_nearest_cache(KEY, prompt(2)[1])
            assert got[0].offset == len(TEXT)
    finally:
        server.close()


def test_a_stored_prefix_never_ends_on_half_an_image_id(llama, tmp_path):
    """Two images whose 60-bit ids share their upper 30 bits: the stored tokens agree one position into the image.
    The hit must stop at the image's start, never serve the other image's first row."""
    start = len(TEXT)
    ids = [-1 - ((5 << 30) | 1), -1 - ((5 << 30) | 2)]
    keys = [TEXT + [n] * 6 + [20, 30] for n in ids]
    tokens = TEXT + [PATCH] * 6 + [20, 30]
    assert storable_key(keys[0])[start] == storable_key(keys[1])[start]  # the upper halves agree
    with open_store(tmp_path / "store", identity=Identity("tiny-llama", "cfg", "tok")) as store:
        writer = tiered(store)
        writer.scopes.take(keys[0])
        writer.insert_cache(KEY, list(keys[0]), filled(llama, tokens))
        assert writer.flush(timeout=60)
        reader = tiered(store)
        got, rest = reader.fetch_nearest_cache(KEY, keys[1])
        assert got[0].offset == start and rest == keys[1][start:]
