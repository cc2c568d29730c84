"""Forgetting a tenant: every snapshot, prefix checkpoint, generation checkpoint, pin and shared-tier entry whose
namespace lies in the tenant's scope, in every identity.

Why it works by namespace: a tenant is a namespace scope (``identity.tenant_scope``), so every record the tenant made
names it — local summaries carry the whole namespace, and so do the shared tier's summaries. The local snapshots go
in one write transaction through ``Removal.drop`` (its followers drop the pins and the checkpoint records with them;
a crash before the commit leaves everything, after it the unlinks are redone by ``gc``), then the tier's entries.
Chunks nobody references any more become orphans for ``gc`` — locally, ``Removal`` unlinks dead packs at once.

With encryption at rest, the tenant's wrapped data key is destroyed *before* any of this (``keys``, a callable
handed in by the assembly): a pack or a Redis value copied earlier can then never be opened again, whatever this
removal misses or a crash interrupts.
"""

from __future__ import annotations

from collections.abc import Callable

from ...errors import CorruptData, InvalidCacheState
from .. import inputs
from ..context import StoreContext
from ..identity import tenant_of, tenant_token
from ..index import tables
from ..liveness.removal import Removal
from ..liveness.transactions import Transactions
from ..remote.maintenance import RemoteAdmin


class TenantForget:
    def __init__(self, ctx: StoreContext, txns: Transactions, removal: Removal,
                 destroy_key: Callable[[str], bool] = lambda token: False):
        self.ctx, self.txns, self.removal, self.destroy_key = ctx, txns, removal, destroy_key

    def forget(self, tenant: str) -> dict[str, int]:
        """Forget ``tenant`` (not the default tenant ``""``: that is every store written before tenants): what was
        removed — ``snapshots`` (local, checkpoints included), ``remote_entries``, ``key_destroyed`` (0/1)."""
        self.ctx.check_writable("forget_tenant")
        self.ctx.check_open()
        inputs.check_tenant(tenant)
        if tenant == "":
            raise InvalidCacheState("forget_tenant needs a tenant name: the default tenant \"\" is the whole "
                                           f"untenanted store at {self.ctx.root} (delete its sessions instead)")
        token = tenant_token(tenant)
        report = {"key_destroyed": int(bool(self.destroy_key(token))), "snapshots": 0, "remote_entries": 0}

        def drop_all(txn):
            sids = [bytes(sid) for sid, _ in txn.range("summaries") if self._tenant_of(txn, bytes(sid)) == token]
            # a session's prefix checkpoints go with it (a follower), so a later sid of the list may be gone already
            return len(sids), [d for sid in sids if (d := self.removal.drop(txn, sid, "tenant forgotten")) is not None]

        with self.ctx.removers.removing():
            found, dropped = self.txns.write(drop_all)
            for d in dropped:
                self.removal.after(*d)
        report["snapshots"] = found  # each also dropped its pin and checkpoint records (Removal's followers)
        tier = self.ctx.tier
        if tier is not None:
            tier.flush()  # a publish of the tenant's still queued would land after the removal
            report["remote_entries"] = RemoteAdmin(None, prefix=tier.keys.prefix, client=tier.client).forget_tenant(token)
        return report

    @staticmethod
    def _tenant_of(txn, sid: bytes) -> str | None:
        try:
            s = tables.summary(txn, sid)
        except CorruptData:  # a damaged summary names no tenant: verify/repair deal with it
            return None
        return None if s is None else tenant_of(s.namespace)


__all__ = ["TenantForget"]
