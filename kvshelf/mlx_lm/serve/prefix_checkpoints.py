"""``kvshelf serve --checkpoint-every N``: prefix checkpoints along the prompt for models whose caches cannot be cut
(docs/CHECKPOINTS.md; not the generation checkpoints of ``--generation-checkpoint-every``, ``generations.py``).

Why: mlx-lm's server splits a chat prompt that ends with a user message into segments (system, user, the thinking
tail) and inserts the cache at each segment's end; a hybrid (Qwen3-Next), recurrent (Mamba) or sliding-window model
can only be served from such an insert, at its exact length. When a later prompt leaves the cached sequence
anywhere else — a thinking template re-rendering an earlier tool step without its reasoning after an agent's
requests that ended with tool results (which mlx-lm does not split), an edited question over a long document — only
the system prompt is reusable. Here the prompt is split further at every multiple of N tokens (absolute
positions), so the batch generator stops there and the server's cache inserts at those boundaries become
*checkpoints*. They are not put in RAM (a copy of the whole cache per boundary would crowd out mlx-lm's own
entries); only their layers that cannot be cut are held, until the request's own insert of a sequence they are a
prefix of, whose caches give the attention layers (cut at each boundary); they are then written behind with it as
that session's store checkpoints (``store.save_async(..., checkpoints=...)``: the attention chunks are the
session's, only the recurrent or window state is new bytes). A later prompt that diverges inside is served from the
nearest checkpoint before the divergence (``source=disk cached=3072 checkpoint=yes``).

Only for models that need it (``needs_prefix_checkpoints``): an all-attention model is cut at any length already.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

PREFIX_CHECKPOINT = "checkpoint"  # the segment type of a piece that ends at a multiple of --checkpoint-every
HELD = 64  # prefix checkpoint inserts held at most (the oldest go first: a request that never finished)


def needs_prefix_checkpoints(model: Any) -> bool:
    """True when some layer's cache cannot be cut back (recurrent state, a sliding-window ring)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..prefix_checkpoints import cuttable

    return not all(cuttable(c) for c in make_prompt_cache(model))


def split_segments(segments: Sequence[Sequence[int]], segment_types: Sequence[str],
                   every: int) -> tuple[list[list[int]], list[str]]:
    """mlx-lm's segments, each also split at every multiple of ``every`` absolute positions: a piece that ends at
    such a multiple (and not at its segment's own end) has the type ``PREFIX_CHECKPOINT``; the last piece of a segment
    keeps the segment's type."""
    out, types, pos = [], [], 0
    for seg, kind in zip(segments, segment_types):
        seg = list(seg)
        start, end = pos, pos + len(seg)
        cut = (start // every + 1) * every
        while cut < end:
            out.append(seg[start - pos:cut - pos])
            types.append(PREFIX_CHECKPOINT)
            start, cut = cut, cut + every
        out.append(seg[start - pos:])
        types.append(kind)
        pos = end
    return out, types


class HeldPrefixCheckpoints:
    """Checkpoint inserts waiting for the insert of a sequence they are a prefix of (module docstring)."""

    def __init__(self, limit: int = HELD):
        self.limit = limit
        self._held: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def hold(self, tokens: Sequence[int], cache: Any, scope: str = "") -> None:
        """Keep the layers of ``cache`` (the batch generator's extracted copy) that cannot be cut; None for the
        others. Held per tenant ``scope``: only that tenant's session write takes it."""
        from ..prefix_checkpoints import cuttable

        small = [None if cuttable(c) else c for c in cache]
        with self._lock:
            key = (scope, tuple(tokens))
            self._held[key] = small
            self._held.move_to_end(key)
            while len(self._held) > self.limit:
                self._held.popitem(last=False)

    def take_for(self, tokens: Sequence[int], cache: Sequence[Any], scope: str = "") -> dict[int, Any]:
        """``{k: caches_at_k}`` of every held checkpoint that is a proper prefix of ``tokens`` (taken: no longer
        held), its attention layers cut from ``cache``, the caches after ``tokens``."""
        from ..prefix_checkpoints import checkpoint_caches

        n = len(tokens)
        with self._lock:
            mine = [key for key in self._held
                    if key[0] == scope and len(key[1]) < n and list(key[1]) == list(tokens[:len(key[1])])]
            held = {len(key[1]): self._held.pop(key) for key in mine}
        return {k: checkpoint_caches(small, cache, k) for k, small in held.items()}

    def __len__(self) -> int:
        return len(self._held)


__all__ = ["PREFIX_CHECKPOINT", "HeldPrefixCheckpoints", "needs_prefix_checkpoints", "split_segments"]
