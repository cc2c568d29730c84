"""The budget: with ``max_bytes``, a handle evicts its own identity's least-recently-used, unleased snapshots after
each save until the store's stored bytes (all identities) fit. Other identities' snapshots are never evicted, and
neither are pinned sessions (``pins.py``)."""

from __future__ import annotations

from ..context import StoreContext
from ..index import keys
from ..index.protocol import meta_int
from ..liveness.reclaim import Reclaimer
from ..liveness.removal import Removal
from ..liveness.transactions import Transactions
from .pins import Pins


class Budget:
    def __init__(self, ctx: StoreContext, txns: Transactions, reclaimer: Reclaimer, removal: Removal, pins: Pins):
        self.ctx, self.txns, self.reclaimer, self.removal, self.pins = ctx, txns, reclaimer, removal, pins

    def evict(self, protect: bytes | None = None) -> int:
        """Evict until ``total_bytes <= max_bytes`` (never ``protect``, never a leased snapshot); returns how many."""
        ctx = self.ctx
        if ctx.max_bytes is None:
            return 0
        evicted = 0
        while True:
            leased = self.reclaimer.live_leases()[0]  # a lease taken after this is safe: unlinking re-reads them

            def pick(txn):
                if meta_int(txn, b"total_bytes") <= ctx.max_bytes:
                    return None
                for key, _ in txn.range("lru", ctx.id_key, keys.after_prefix(ctx.id_key)):
                    # the handle's pending uses were applied first
                    sid = keys.lru_sid(key)
                    if sid == protect or sid.hex() in leased:
                        continue
                    if self.pins.protects(txn, sid):  # pinned (pins.py): never a victim
                        continue
                    return self.removal.drop(txn, sid, "evicted")
                return None

            with ctx.removers.removing():  # from the commit to the unlink (removers.py)
                victim = self.txns.write(pick)
                if victim is None:
                    return evicted
                self.removal.after(*victim)
            evicted += 1
            ctx.counters.evicted += 1


__all__ = ["Budget"]
