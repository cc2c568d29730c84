"""A handle's collaborators, built in order from one ``StoreContext``: the store's wiring, and only that.

Why its own module: the façade (``store.py``) should read as the list of public calls, each a delegation; which
collaborator needs which — the order below — is a fact about the rooms, stated once here. Each collaborator
receives in its constructor what it calls; where two rooms must not import each other, the call is handed in as a
bound method (a prefix checkpoint saves through ``SessionSaves``; a delete drops the checkpoints' records).

Order: ``Reclaimer``, ``Transactions`` (+ ``UseBook``), ``Leases``, ``Pins``, ``Snapshots``, ``SessionSaves``'s
writer, ``Checkpoints``, ``Removal`` (pins and prefix checkpoints follow a dropped session), ``Gc``, ``FullDisk``,
``Quarantine``, ``Reader``, ``Saver`` (+ ``Budget``), ``IndexSwap``, ``Verifier``, ``StoreAdmin``, ``Repair``,
then the public-call collaborators: ``SessionSaves``, ``Lookups``, ``Restores``, ``Keeping``, ``TenantForget``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .admin.forget import TenantForget
from .admin.index_swap import IndexSwap
from .admin.surface import StoreAdmin
from .context import StoreContext
from .integrity.gc import Gc
from .integrity.good_copies import GoodCopies
from .integrity.legacy_v1 import seal_v1_manifests
from .integrity.quarantine import Quarantine
from .integrity.rebuild import Rebuild
from .integrity.repair import Repair
from .integrity.verify import Verifier
from .liveness.leases import Leases
from .liveness.reclaim import Reclaimer
from .liveness.removal import Removal
from .liveness.save_gate import SaveGate
from .liveness.transactions import Transactions
from .opening import close_context
from .prefix.lookups import Lookups
from .remote.maintenance import RemoteAdmin
from .remote.tier import RemoteTier
from .restore.reader import Reader
from .restore.restores import Restores
from .restore.snapshots import Snapshots
from .save.background import BackgroundWriter
from .save.checkpoints import Checkpoints
from .save.saver import Saver
from .save.session_saves import SessionSaves
from .space.budget import Budget
from .space.full_disk import FullDisk
from .space.keeping import Keeping
from .space.pins import Pins


@dataclass
class Collaborators:
    """What a ``Store`` delegates to. ``close`` stops them in the order that loses nothing: queued saves are written
    (and published), the shared tier flushed, remembered uses written, then the context closed."""

    ctx: StoreContext
    gate: SaveGate
    txns: Transactions
    leases: Leases
    pins: Pins
    checkpoints: Checkpoints
    quarantine: Quarantine
    repair: Repair
    admin: StoreAdmin
    saves: SessionSaves
    lookups: Lookups
    restores: Restores
    keeping: Keeping
    writer: BackgroundWriter
    budget: Budget
    forget: TenantForget

    def close(self) -> None:
        if self.ctx.closed:
            return
        self.writer.close()
        if self.ctx.tier is not None:  # after queued saves: they publish too
            self.ctx.tier.close()
        try:
            self.txns.close()  # remembered uses are written
        finally:
            close_context(self.ctx)


def assemble(ctx: StoreContext, gate: SaveGate, *, max_pending_bytes: int, clock=None) -> Collaborators:
    """Build one handle's collaborators in order (module docstring)."""
    reclaimer = Reclaimer(ctx)
    txns = Transactions(ctx, reclaimer)
    leases = Leases(ctx, reclaimer, txns.uses)
    pins = Pins(ctx, clock)  # clock: seconds (time.time); tests check pins' TTLs with a fake one
    snapshots = Snapshots(ctx)
    writer = BackgroundWriter(max_pending_bytes)
    # the prefix checkpoints save through SessionSaves, which needs them back: the closures read ``saves`` (and the
    # saver), both built below, when a checkpoint is saved
    checkpoints = Checkpoints(lambda: ctx.index, snapshots.scoped_session_key,
                              lambda *a: saves.save_derived(*a), lambda *a: saver.capture(*a),
                              lambda cap: saves.published(saver.write(cap)))
    removal = Removal(ctx, reclaimer, followers=(pins, checkpoints))
    gc = Gc(ctx, gate, txns, reclaimer)
    full_disk = FullDisk(ctx, txns, removal, gc)  # sizes and takes the reserve from the index
    quarantine = Quarantine(ctx, txns, full_disk, removal)
    reader = Reader(ctx, leases, snapshots, quarantine)
    budget = Budget(ctx, txns, reclaimer, removal, pins)
    saver = Saver(ctx, gate, txns, reclaimer, budget)
    swap = IndexSwap(ctx, gate, txns, writer.flush)
    verifier = Verifier(ctx, gate, reclaimer)
    admin = StoreAdmin(ctx, snapshots=snapshots, leases=leases, reclaimer=reclaimer, txns=txns, gate=gate,
                       saver=saver, writer=writer, verifier=verifier, gc=gc, rebuild=Rebuild(ctx, swap), swap=swap,
                       pins=pins, reader=reader)
    repair = Repair(ctx, txns, removal, quarantine, verifier, gc, GoodCopies(ctx, txns, gate, reclaimer,
                                                                            saver.write_pack),
                    rewrite_packs=lambda packs: admin.repack(packs=packs),
                    open_remote=lambda remote, prefix: RemoteAdmin(remote, prefix=prefix))
    saves = SessionSaves(ctx, saver, writer, checkpoints, full_disk.keep_reserve, snapshots.manifest)
    lookups = Lookups(ctx, txns.uses)
    restores = Restores(ctx, reader, snapshots, lookups.lookup, txns.uses)
    keeping = Keeping(ctx, full_disk, pins, snapshots.scoped_session_key, Checkpoints.drop_quarantined)
    def destroy_key(token: str) -> bool:  # encryption at rest: forget_tenant destroys the tenant's data key first
        return ctx.keys is not None and ctx.keys.destroy(token)

    if not ctx.read_only:  # once per index: v1 manifest files get the checksum rebuilds need
        seal_v1_manifests(ctx.index, ctx.bytes)
    return Collaborators(ctx, gate, txns, leases, pins, checkpoints, quarantine, repair, admin, saves, lookups,
                         restores, keeping, writer, budget, TenantForget(ctx, txns, removal, destroy_key))


def bind_remote(parts: Collaborators, remote: Any, prefix: str, options: dict[str, Any]) -> None:
    """Add the shared tier (``remote/tier.py``) to an open handle: it reads manifests through the snapshots, chunks
    under the admin's leases, and keeps a remote hit locally through the handle's ``save``."""
    RemoteTier(remote, prefix=prefix, **options).bind(parts.ctx, parts.restores.snapshots, parts.admin.lease,
                                                      parts.saves.save)


__all__ = ["Collaborators", "assemble", "bind_remote"]
