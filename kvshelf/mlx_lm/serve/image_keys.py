"""Image prompts as storable keys: mlx-lm's negative image ids mapped, one to one, onto reserved token ids.

Why: mlx-lm 0.32's server keys a prompt with images by its *cache key*: the prompt with every patch token of an image
replaced by that image's id, ``-1 - int(sha256(url)[:15], 16)`` (the url is a data URL, http images are inlined
first: the id names the image *content*), because two images of one size give the same patch tokens. The store
holds token ids in ``[0, 2**31)`` only, so these prompts stayed in RAM and were lost at every restart.

The mapping (``storable_key``), position for position, so a cache row still sits at its token's position:

- a text token ``t`` stays ``t``; it must lie below ``RESERVED`` (2**30: no tokenizer has a billion tokens), so the
  reserved range never collides with the vocabulary;
- an image is a run of ``k`` equal negative ids ``n`` (mlx-lm starts a new image only after a non-patch token, so
  two images are never adjacent: they are separated by text). With ``m = -1 - n`` (60 bits), the run becomes
  ``RESERVED + (m >> 30)``, ``RESERVED + (m & (2**30 - 1))``, then those two repeated to length ``k``.

Injective on mlx-lm's keys: text tokens are below ``RESERVED`` and image tokens at or above it, so the runs are
where they were; each run's first two tokens give ``m`` back and its length gives ``k``. So the same text with
another image never shares the image's positions, two images swapped differ at the first image, and the text before
the first image is the same tokens as a text prompt's (shared with it and between images). What cannot be mapped is
left to RAM as before (``None``): an image of a single patch token (30 bits cannot hold its id), two different
images adjacent (not mlx-lm's keys), a text token at or above ``RESERVED``.

A stored prefix may end inside an image only after the image's first two tokens (its whole id) matched:
``trusted_length`` cuts a longer hit back to the image's start otherwise, so a 30-bit half never stands for an image.
"""

from __future__ import annotations

from collections.abc import Sequence

RESERVED = 1 << 30
_HALF = (1 << 30) - 1


def storable_key(tokens: Sequence[int]) -> Sequence[int] | None:
    """``tokens`` (a text prompt: the same object) or its image-mapped copy, or None when it cannot be stored."""
    if not tokens:
        return tokens
    lo, hi = min(tokens), max(tokens)
    if hi >= RESERVED:
        return None
    if lo >= 0:
        return tokens
    out = list(tokens)
    i, n = 0, len(out)
    while i < n:
        t = out[i]
        if t >= 0:
            i += 1
            continue
        j = i
        while j < n and out[j] == t:
            j += 1
        if j - i < 2 or (j < n and out[j] < 0):  # a one-token image, or another image right after it
            return None
        m = -1 - t
        pair = (RESERVED + (m >> 30), RESERVED + (m & _HALF))
        for p in range(i, j):
            out[p] = pair[(p - i) & 1]
        i = j
    return out


def trusted_length(key: Sequence[int], length: int) -> int:
    """``length`` of a stored prefix of ``key`` (a ``storable_key``), cut back to the start of an image when it ends
    after fewer than two of that image's tokens (then only half its id matched)."""
    if length <= 0 or length > len(key) or key[length - 1] < RESERVED:
        return length
    start = length - 1
    while start > 0 and key[start - 1] >= RESERVED:
        start -= 1
    return start if length - start < 2 else length


__all__ = ["RESERVED", "storable_key", "trusted_length"]
