"""The budget: with ``max_bytes``, a handle evicts its own identity's least-recently-used, unleased snapshots after
each save until the store's stored bytes (all identities) fit. Other identities' snapshots are never evicted, and
neither are pinned sessions (``pins.py``).

Per-tenant quotas (``tenant_max_bytes``): after a save of tenant T, while T's sessions (this identity's snapshots whose
namespace is in T's scope, checkpoints included) hold more than T's quota, T's least-recently-used unpinned,
unleased snapshot is evicted — never another tenant's, so a tenant that floods the store evicts only itself. A
tenant's usage is the sum of its snapshots' bytes (``Summary.nbytes``: chunks shared between its own snapshots count
once per snapshot, so the quota is conservative); pins count against their tenant but are never victims. The usage
is counted from the index at each eviction (one scan of the identity's LRU), not kept in a counter that a crash or
a concurrent handle could leave wrong. Opening a writable store with quotas also evicts every tenant found over its
quota (``enforce_tenants``): what a writer killed between a save's commit and its eviction left behind."""

from __future__ import annotations

from ...errors import InvalidCacheState, WrongArgumentType
from ..context import StoreContext
from ..identity import tenant_of, tenant_token
from ..index import keys, tables
from ..index.protocol import meta_int
from ..liveness.reclaim import Reclaimer
from ..liveness.removal import Removal
from ..liveness.transactions import Transactions
from .pins import Pins


class Budget:
    def __init__(self, ctx: StoreContext, txns: Transactions, reclaimer: Reclaimer, removal: Removal, pins: Pins):
        self.ctx, self.txns, self.reclaimer, self.removal, self.pins = ctx, txns, reclaimer, removal, pins

    def set_tenant_limit(self, tenant: str, max_bytes: int | None) -> None:
        """``tenant``'s quota in bytes (``"*"``: every tenant without its own; None: drop it). Applies from the next save."""
        _check_limit(max_bytes, f"the quota of tenant {tenant!r}")
        token = "*" if tenant == "*" else tenant_token(tenant)
        if max_bytes is None:
            self.ctx.tenant_max_bytes.pop(token, None)
        else:
            self.ctx.tenant_max_bytes[token] = max_bytes

    def evict(self, protect: bytes | None = None) -> int:
        """The global budget, then ``protect``'s tenant's quota; how many snapshots were evicted."""
        return self.evict_global(protect) + self.evict_tenant(protect)

    def usage(self, txn, token: str) -> tuple[int, list[bytes]]:
        """Tenant ``token``'s bytes in this identity, and its snapshots least recently used first."""
        used, sids = 0, []
        for sid, s in self._by_use(txn):
            if tenant_of(s.namespace) == token:
                used += s.nbytes
                sids.append(sid)
        return used, sids

    def _by_use(self, txn):
        """(snapshot id, summary) of this identity's snapshots, least recently used first."""
        for key, _ in txn.range("lru", self.ctx.id_key, keys.after_prefix(self.ctx.id_key)):
            sid = keys.lru_sid(key)
            s = tables.summary(txn, sid)
            if s is not None:
                yield sid, s

    def evict_tenant(self, protect: bytes | None) -> int:
        """Evict ``protect``'s tenant's LRU snapshots (never ``protect``, a leased or a pinned one) to its quota."""
        ctx, limits = self.ctx, self.ctx.tenant_max_bytes
        if not limits or protect is None:
            return 0
        with ctx.index.read() as txn:
            s = tables.summary(txn, protect)
        if s is None:
            return 0
        return self._evict_to_quota(tenant_of(s.namespace), protect)

    def enforce_tenants(self) -> int:
        """Evict every tenant of this identity that is over its quota down to it (nothing protected); how many
        snapshots went. Why: the quota is otherwise enforced only after that tenant's own saves, so a writer killed
        between a save's commit and its eviction (or a quota lowered since) would leave the tenant over its quota
        until it saves again — which an idle or departed tenant never does. Opening a store with quotas runs it."""
        if not self.ctx.tenant_max_bytes:
            return 0
        used: dict[str, int] = {}
        with self.ctx.index.read() as txn:  # one scan; only a tenant found over its quota is scanned again
            for _sid, s in self._by_use(txn):
                token = tenant_of(s.namespace)
                used[token] = used.get(token, 0) + s.nbytes
        over = [t for t, n in sorted(used.items()) if (limit := self._limit(t)) is not None and n > limit]
        return sum(self._evict_to_quota(token, None) for token in over)

    def _limit(self, token: str) -> int | None:
        limits = self.ctx.tenant_max_bytes
        return limits.get(token, limits.get("*"))

    def _evict_to_quota(self, token: str, protect: bytes | None) -> int:
        limit = self._limit(token)
        if limit is None:
            return 0

        def over(txn):
            used, sids = self.usage(txn, token)
            return sids if used > limit else None

        return self._evict(over, protect, "evicted (tenant quota)")

    def evict_global(self, protect: bytes | None = None) -> int:
        """Evict until ``total_bytes <= max_bytes`` (never ``protect``, never a leased snapshot); returns how many."""
        ctx = self.ctx
        if ctx.max_bytes is None:
            return 0

        def over(txn):
            if meta_int(txn, b"total_bytes") <= ctx.max_bytes:
                return None
            # the handle's pending uses were applied first
            return (keys.lru_sid(key) for key, _ in txn.range("lru", ctx.id_key, keys.after_prefix(ctx.id_key)))

        return self._evict(over, protect, "evicted")

    def _evict(self, over, protect: bytes | None, why: str) -> int:
        """The one eviction loop of both budgets: while ``over(txn)`` gives candidates (least recently used first),
        drop the first that is not ``protect``, leased or pinned (pins.py: never a victim), one write transaction per
        victim, and unlink its files after the commit (removers.py); returns how many were evicted."""
        ctx = self.ctx
        evicted = 0
        while True:
            leased = self.reclaimer.live_leases()[0]  # a lease taken after this is safe: unlinking re-reads them

            def pick(txn):
                candidates = over(txn)
                if candidates is None:
                    return None
                for sid in candidates:
                    if sid == protect or sid.hex() in leased or self.pins.protects(txn, sid):
                        continue
                    return self.removal.drop(txn, sid, why)
                return None

            with ctx.removers.removing():  # from the commit to the unlink (removers.py)
                victim = self.txns.write(pick)
                if victim is None:
                    return evicted
                self.removal.after(*victim)
            evicted += 1
            ctx.counters.evicted += 1

def _check_limit(max_bytes, what: str) -> None:
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
        raise InvalidCacheState(f"{what} must be an int >= 0 or None, got {max_bytes!r}")


def tenant_limits(tenant_max_bytes) -> dict[str, int]:
    """``open_store``'s ``tenant_max_bytes`` (an int for every tenant, or ``{tenant: bytes}``) keyed by tenant token."""
    if tenant_max_bytes is None:
        return {}
    if not isinstance(tenant_max_bytes, dict):
        _check_limit(tenant_max_bytes, "tenant_max_bytes")
        return {"*": tenant_max_bytes}
    out = {}
    for tenant, limit in tenant_max_bytes.items():
        if not isinstance(tenant, str):
            raise WrongArgumentType(f"tenant_max_bytes keys must be tenant names (str), got {type(tenant).__name__}")
        _check_limit(limit, f"tenant_max_bytes[{tenant!r}]")
        out["*" if tenant == "*" else tenant_token(tenant)] = limit
    return out


__all__ = ["Budget", "tenant_limits"]
