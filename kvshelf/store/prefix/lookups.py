"""The store's lookup calls: which stored prefix a prompt reuses, and why none does.

Why here and not in the façade: a lookup is the prefix room's search over the index's records (local first), the
bad-chunk rule (a hit that would fail its restore is a miss, so the caller's next save heals the copy), the shared
tier when it gives a longer prefix, and a prefix checkpoint reported as its session's. ``uses`` (the handle's
remembered uses, ``liveness/uses.py``) orders equal candidates by recency; it is handed in.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import inputs
from ..context import StoreContext
from ..identity import namespace_key
from ..index import bad_chunks
from ..index.keys import parent_of
from ..results import PrefixHit
from .explain import explain_miss
from .index_records import IndexRecords
from .search import LazyTokens, PrefixSearch


class Lookups:
    """``lookup`` and ``explain_miss`` of one handle (``Store.lookup`` / ``Store.explain_miss`` delegate here)."""

    def __init__(self, ctx: StoreContext, uses):
        self.ctx, self.uses = ctx, uses

    def lookup(self, prompt_tokens: Sequence[int], namespace: str = "") -> PrefixHit | None:
        prompt_tokens, _ = inputs.check_prompt(prompt_tokens), inputs.check_namespace(namespace)
        self.ctx.check_scoped("lookup")
        prompt = LazyTokens(prompt_tokens, "prompt_tokens")
        nsk = namespace_key(self.ctx.id_key, namespace)
        self.ctx.counters.lookups += 1
        with self.ctx.index.read() as txn:
            found = PrefixSearch(IndexRecords(txn, self.uses.touched()), nsk, prompt, self.ctx.block).run()
            if found is not None and bad_chunks.uses_bad(txn, found.sid, found.length):
                found = None  # it would fail its restore: a miss, so the caller's next save heals the copy
        hit = None if found is None else PrefixHit(found.summary.session_id, found.sid.hex(), found.length,
                                                   found.summary.namespace, found.summary.length)
        if self.ctx.tier is not None:  # local first; the shared tier only when it gives a longer prefix
            hit = self.ctx.tier.lookup(prompt, namespace, hit)
        parent = None if hit is None else parent_of(hit.session_id)
        if parent is not None:  # a prefix checkpoint (save/checkpoints.py): reported as its session's
            hit = PrefixHit(parent[0], hit.snapshot_id, hit.length, hit.namespace, hit.snapshot_length, True)
        if hit is not None:
            self.ctx.counters.hits += 1
        return hit

    def explain_miss(self, prompt_tokens: Sequence[int], namespace: str = "") -> str:
        prompt_tokens, _ = inputs.check_prompt(prompt_tokens), inputs.check_namespace(namespace)
        self.ctx.check_scoped("explain_miss")
        with self.ctx.index.read() as txn:
            return explain_miss(txn, self.ctx.id_key, namespace, LazyTokens(prompt_tokens, "prompt_tokens"),
                                self.ctx.block)


__all__ = ["Lookups"]
