"""``kvshelf serve --checkpoint-every N``: checkpoints along the prompt for models whose caches cannot be cut.

Why: mlx-lm's server splits a chat prompt into segments (system, user, the thinking tail) and inserts the cache at
each segment's end; a hybrid (Qwen3-Next), recurrent (Mamba) or sliding-window model can only be served from such
an insert at its exact length. A thinking model's template drops the reasoning from the history, so the second
turn's prompt diverges from the cached sequence right after the first turn's prompt: nothing but the system prompt
is reusable. Here the prompt is split further at every multiple of N tokens (absolute positions), so the batch
generator stops there and the server's cache inserts at those boundaries become *checkpoints*: they are held (not
put in RAM: one copy of the whole cache per boundary would crowd out mlx-lm's own entries) until the request's
own insert of a sequence they are a prefix of, and written behind with it as that session's store checkpoints
(``store.save_async(..., checkpoints=...)``: the attention chunks are shared with the session, only the recurrent
or window state is new bytes). A later prompt that diverges inside is served from the nearest checkpoint before
the divergence (``source=disk cached=3072 checkpoint=yes``).

Only for models that need it (``needs_checkpoints``): an all-attention model is cut at any length already.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

CHECKPOINT = "checkpoint"  # the segment type of a piece that ends at a multiple of --checkpoint-every
HELD = 64                  # checkpoint inserts held at most (the oldest go first: a request that never finished)


def needs_checkpoints(model: Any) -> bool:
    """True when some layer's cache cannot be cut back (recurrent state, a sliding-window ring)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..checkpoints import cuttable

    return not all(cuttable(c) for c in make_prompt_cache(model))


def split_segments(segments: Sequence[Sequence[int]], segment_types: Sequence[str],
                   every: int) -> tuple[list[list[int]], list[str]]:
    """mlx-lm's segments, each also split at every multiple of ``every`` absolute positions: a piece that ends at
    such a multiple (and not at its segment's own end) has the type ``CHECKPOINT``; the last piece of a segment
    keeps the segment's type."""
    out, types, pos = [], [], 0
    for seg, kind in zip(segments, segment_types):
        seg = list(seg)
        start, end = pos, pos + len(seg)
        cut = (start // every + 1) * every
        while cut < end:
            out.append(seg[start - pos:cut - pos])
            types.append(CHECKPOINT)
            start, cut = cut, cut + every
        out.append(seg[start - pos:])
        types.append(kind)
        pos = end
    return out, types


class HeldCheckpoints:
    """Checkpoint inserts waiting for the insert of a sequence they are a prefix of (module docstring)."""

    def __init__(self, limit: int = HELD):
        self.limit = limit
        self._held: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def hold(self, tokens: Sequence[int], cache: Any) -> None:
        with self._lock:
            self._held[tuple(tokens)] = cache
            self._held.move_to_end(tuple(tokens))
            while len(self._held) > self.limit:
                self._held.popitem(last=False)

    def take_for(self, tokens: Sequence[int]) -> dict[int, Any]:
        """``{k: cache}`` of every held checkpoint that is a proper prefix of ``tokens`` (taken: no longer held)."""
        n = len(tokens)
        with self._lock:
            mine = [key for key in self._held if len(key) < n and list(key) == list(tokens[:len(key)])]
            return {len(key): self._held.pop(key) for key in mine}

    def __len__(self) -> int:
        return len(self._held)


__all__ = ["CHECKPOINT", "HeldCheckpoints", "needs_checkpoints", "split_segments"]
