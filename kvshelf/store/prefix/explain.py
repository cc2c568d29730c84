"""Why a lookup found nothing: the cause an operator can act on, not just "miss".

A prompt gets no stored prefix for one of a few reasons, and they call for different fixes: nothing like it was
ever stored (warm it), a stored prefix belongs to another model identity (another model, config or tokenizer:
never reusable, by design), the shared prefix is shorter than the snapshot's ``minimum_reusable_offset`` (the floor),
or the snapshot holds state that cannot be cut back (a recurrent or wrapped sliding-window cache) and the prompt
diverges before its end (checkpoints along the prompt serve that: ``save/checkpoints.py``).

How: the one prefix search runs again with every candidate taken as usable (``Unrestricted``: the floor and the
cut rule lifted), which finds the longest shared prefix among this identity's current snapshots; the original
summary of that snapshot then says which rule refused it. With nothing shared, each other identity in the store
(a few at most: one per model a store serves) is searched the same way. Only a miss pays for this, and only when
the caller asks (``Store.explain_miss``).
"""

from __future__ import annotations

from collections.abc import Sequence

from msgspec.structs import replace

from ..identity import namespace_key
from ..index import keys
from ..index.schema import Summary
from .index_records import IndexRecords
from .search import LazyTokens, PrefixSearch

NOTHING_STORED = "nothing_stored"
OTHER_IDENTITY = "other_identity"
BELOW_FLOOR = "below_floor"
NOT_EXACT_LENGTH = "not_exact_length"  # recurrent or rotating state, and the prompt diverges before its end
REASONS = (NOTHING_STORED, OTHER_IDENTITY, BELOW_FLOOR, NOT_EXACT_LENGTH)


class Unrestricted(IndexRecords):
    """The index's records with every candidate usable at any length; ``original`` keeps the real summaries."""

    def __init__(self, txn, touched=None):
        super().__init__(txn, touched)
        self.original: dict[bytes, Summary] = {}

    def summaries(self, sids: Sequence[bytes]) -> list[Summary | None]:
        out = []
        for sid, s in zip(sids, super().summaries(sids)):
            if s is not None:
                self.original[sid] = s
                s = replace(s, minimum_reusable_offset=0, trimmable=True)
            out.append(s)
        return out


def _shared(txn, nsk: bytes, prompt: LazyTokens, block: int):
    source = Unrestricted(txn)
    found = PrefixSearch(source, nsk, prompt, block).run()
    return (None, None) if found is None else (found.length, source.original.get(found.sid))


def _other_identities(txn, id_key: bytes):
    """Every other identity key with a snapshot in the store (the ``lru`` table is ordered by identity first)."""
    start = b""
    while True:
        first = next(iter(txn.range("lru", start, None)), None)
        if first is None:
            return
        other = bytes(first[0][:16])
        if other != id_key:
            yield other
        start = keys.after_prefix(other)
        if start is None:
            return


def explain_miss(txn, id_key: bytes, namespace: str, prompt: LazyTokens, block: int) -> str:
    """The reason (``REASONS``) the prompt got no usable stored prefix, read in ``txn``."""
    p, s = _shared(txn, namespace_key(id_key, namespace), prompt, block)
    if s is not None and p:
        if p < s.minimum_reusable_offset:
            return BELOW_FLOOR
        if p < s.length and not s.trimmable:
            return NOT_EXACT_LENGTH
        return NOTHING_STORED
    for other in _other_identities(txn, id_key):
        if _shared(txn, namespace_key(other, namespace), prompt, block)[0]:
            return OTHER_IDENTITY
    return NOTHING_STORED


__all__ = ["BELOW_FLOOR", "NOTHING_STORED", "NOT_EXACT_LENGTH", "OTHER_IDENTITY", "REASONS", "Unrestricted",
           "explain_miss"]
