"""When a fetch counts as a hit: ``--min-hit-tokens``.

Why: every chat prompt starts with the template's fixed lead-in (a role token, a BOS), so mlx-lm's RAM trie almost
always gives back a prefix of a token or two. Counted as a "RAM hit", such a prefix made the hit rate read 1 while
half the requests were full prefills, and it threw away the reason the disk or shared tier gave for having nothing.
Here a fetch is a hit of a tier only when that tier gave at least ``min_hit_tokens`` tokens and more than any other
tier could (the tiered cache asks the store only when it could beat RAM, so the tier that gave the longest prefix
is the one that served); otherwise it is a miss, with the reason the store gave (or ``nothing_stored``). The tokens
a trivial prefix saved are still tokens not recomputed: they stay in ``kvshelf_cached_tokens_total{tier}``, which is
the token-level figure; the request-level figure is the hit/miss decided here.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MIN_HIT_TOKENS = 16  # more than any chat template's fixed lead-in; below --min-disk-tokens' worth of a read


@dataclass(frozen=True)
class Verdict:
    """A fetch, classified: ``source`` (the tier that counts as the hit, or ``none``), the miss ``reason`` (None
    for a hit) and ``tier``: the tier whose tokens were reused whatever the verdict (None when none were)."""

    source: str
    reason: str | None
    tier: str | None


def classify(tier: str, cached: int, store_reason: str | None, min_hit_tokens: int) -> Verdict:
    """``tier``: the tier that gave the longest prefix (``none`` when none did); ``cached``: its tokens;
    ``store_reason``: why the store (disk or shared tier) had nothing better, when it was asked."""
    reused = tier if tier != "none" and cached > 0 else None
    if reused is not None and cached >= max(1, min_hit_tokens):
        return Verdict(tier, None, reused)
    return Verdict("none", store_reason or "nothing_stored", reused)


__all__ = ["DEFAULT_MIN_HIT_TOKENS", "Verdict", "classify"]
