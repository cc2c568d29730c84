"""The budget: with ``max_bytes``, a handle evicts its own identity's least-recently-used, unleased snapshots after
each save until the store's stored bytes (all identities) fit. Other identities' snapshots are never evicted."""

from __future__ import annotations

from ..index import keys
from ..index.protocol import meta_int


def evict_to_budget(store, protect: bytes | None = None) -> int:
    """Evict until ``total_bytes <= max_bytes`` (never ``protect``, never a leased snapshot); returns how many."""
    if store.max_bytes is None:
        return 0
    evicted = 0
    while True:
        leased = store._live_leases()[0]  # a lease taken after this is safe: unlinking re-reads the leases

        def pick(txn):
            if meta_int(txn, b"total_bytes") <= store.max_bytes:
                return None
            for key, _ in txn.range("lru", store.id_key, keys.after_prefix(store.id_key)):
                # the handle's pending uses were applied first
                sid = keys.lru_sid(key)
                if sid == protect or sid.hex() in leased:
                    continue
                if store.pins.protects(txn, sid):  # pinned (space/pins.py): never a victim
                    continue
                return store._remove(txn, sid, "evicted")
            return None

        with store.removers.removing():  # from the commit to the unlink (removers.py)
            victim = store._txn(pick)
            if victim is None:
                return evicted
            store._after_drop(*victim)
        evicted += 1
        store.counters["evicted"] += 1


__all__ = ["evict_to_budget"]
