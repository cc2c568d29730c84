"""Repair: what an operator runs after ``verify`` reports damage — rewrite what has a good copy, drop what has none,
reclaim the space, and say exactly what was done and what was lost.

Why apart from ``verify`` and ``gc``: verify never changes anything and gc only takes what nothing references;
repair is the one call that *decides*. It works from the findings of a deep verify, so it repairs only what verify
can show:

* a chunk whose copy failed its hash (a ``bad_chunks`` mark, ``index/bad_chunks.py``, or a deep verify's
  ``corrupt-chunk`` / ``missing-chunk``) and that no save has healed: if a good copy exists — another pack, or the
  shared tier (``good_copies.py``) — it is verified and the chunk record repointed at it, healing every snapshot
  using it (reported as healed, with where the copy came from); otherwise every snapshot using it cannot be
  restored, so each is dropped (reported as lost, with its session); the chunk record and its mark go with the
  last of them;
* a checkpoint whose session is not indexed (``orphan-checkpoint``; none is committed since the save re-checks its
  session in its commit, but an index from before that, or a damaged one, may hold them): dropped;
* a quarantined snapshot: its evidence was for the operator, and running repair is the operator's decision — its
  record is dropped so ``gc`` may take its bytes;
* a pack whose trailer is damaged while its chunks are live (a rebuild from packs would lose them): its live chunks
  and manifests are copied, verified, into fresh packs whose trailers come from the index (``admin``'s repack,
  given to the constructor), and the damaged pack is reclaimed once nothing points at it;
* then ``gc`` reclaims every object nothing references any more.

A dry run reads the same findings and changes nothing. A snapshot is dropped in one write transaction through the
same ``Removal`` a delete uses (tombstone, followers such as pins), so the books stay exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import CorruptData, IncompatibleFormat
from ..context import StoreContext
from ..index import bad_chunks
from ..index import schema
from ..index.schema import ChunkRef, Manifest
from ..liveness.removal import Removal
from ..liveness.transactions import Transactions
from ..results import RepairReport
from .gc import Gc
from .good_copies import GoodCopies
from .quarantine import Quarantine
from .verify import Verifier

_DAMAGED = ("bad-chunk", "corrupt-chunk", "missing-chunk")


class Repair:
    def __init__(self, ctx: StoreContext, txns: Transactions, removal: Removal, quarantine: Quarantine,
                 verifier: Verifier, gc: Gc, copies: GoodCopies, rewrite_packs: Callable[[set[str]], dict],
                 open_remote: Callable[[Any, str], Any]):
        self.ctx, self.txns, self.removal, self.quarantine = ctx, txns, removal, quarantine
        self.verifier, self.gc, self.copies, self.rewrite_packs = verifier, gc, copies, rewrite_packs
        self.open_remote = open_remote  # (URL or seeds, prefix) -> a shared tier's admin handle (remote/maintenance)

    def repair_from(self, dry_run: bool = True, remote: Any = None, remote_prefix: str = "kvshelf:") -> RepairReport:
        """``Store.repair``: ``remote`` names a shared tier (URL or seed list) to take good copies from; default:
        the tier this handle was opened with, if any."""
        self.ctx.check_open()
        if remote is None:
            return self.repair(dry_run, self.ctx.tier)
        with self.open_remote(remote, remote_prefix) as tier:
            return self.repair(dry_run, tier)

    def repair(self, dry_run: bool = True, remote=None) -> RepairReport:
        """Heal the damaged chunks that have a good copy (``remote``: a shared tier to look in too, an object with
        ``good_copy(hash)``), drop the snapshots that use one with none and the quarantined snapshots, reclaim."""
        self.ctx.check_open()
        if not dry_run:
            self.ctx.check_writable("repair")
        findings = self.verifier.verify(deep=True, mark_bad=not dry_run)
        damaged = {f.where[len("chunk "):]: f.sessions for f in findings
                   if f.kind in _DAMAGED and f.where.startswith("chunk ")}
        users, refs = self._users(damaged)
        healed = []
        for h, copy in self.copies.find(damaged, remote).items():
            if dry_run or self.copies.restore(h, copy, refs.get(h) or ChunkRef(h, 0, 0, 0)):
                healed.append({"chunk": h, "source": copy.source, "sessions": sorted(damaged[h])})
        done = {c["chunk"] for c in healed}
        lost = [(sid, s, ns, hit - done) for sid, s, ns, hit in users if hit - done]
        quarantined = [(f.where, f.sessions) for f in findings if f.kind == "quarantined"]
        trailers = sorted(f.where[len("pack "):] for f in findings if f.kind == "damaged-trailer")
        orphans = [f.where.split()[1] for f in findings if f.kind == "orphan-checkpoint"]
        if not dry_run:
            for sid, _session, _namespace, hashes in lost:
                self._drop(sid, f"repair: uses chunk(s) {', '.join(sorted(hashes))} with no good copy")
            for where, _sessions in quarantined:
                self.quarantine.drop_quarantined(where.split()[1])
            for sid in orphans:
                self._drop(sid, "repair: a checkpoint whose session is gone")
            if trailers:  # every live chunk and manifest of the pack copied (verified) under fresh trailers
                self.rewrite_packs(set(trailers))
        sweep = self.gc.gc(dry_run)
        after = [] if dry_run else [f for f in self.verifier.verify(deep=True) if f.kind in _DAMAGED]
        return RepairReport(
            dry_run=dry_run,
            lost=[{"session_id": s, "namespace": ns, "snapshot_id": sid, "chunks": sorted(h)}
                  for sid, s, ns, h in lost],
            dropped_quarantined=[{"snapshot_id": w.split()[1], "session_id": (ss or ("",))[0]}
                                 for w, ss in quarantined],
            bad_chunks=sorted(damaged), healed=healed, dropped_checkpoints=orphans, rewritten_trailers=trailers,
            reclaimed_bytes=sweep.bytes,
            reclaimed_objects=len(sweep.orphan_objects) + len(sweep.orphan_manifests),
            remaining=[f"{f.kind}: {f.where}: {f.detail}" for f in after])

    def _users(self, damaged) -> tuple[list[tuple[str, str, str, set[str]]], dict[str, ChunkRef]]:
        """(snapshot id, session, namespace, damaged chunks it uses) of every indexed snapshot using one, and a
        reference to each damaged chunk (its token range goes into a healed copy's frame metadata)."""
        out: list[tuple[str, str, str, set[str]]] = []
        refs: dict[str, ChunkRef] = {}
        if not damaged:
            return out, refs
        for sid, raw in self.ctx.index.scan("manifests"):
            try:
                m = schema.decode(raw, Manifest, f"manifest {sid.hex()}")
            except (CorruptData, IncompatibleFormat):
                continue
            hit = {r.hash for r in m.all_chunks} & set(damaged)
            if hit:
                out.append((m.snapshot_id, m.session_id, m.namespace, hit))
                refs.update({r.hash: r for r in m.all_chunks if r.hash in hit})
        return out, refs

    def _drop(self, snapshot_id: str, reason: str) -> None:
        result = self.txns.write(lambda txn: self.removal.drop(txn, bytes.fromhex(snapshot_id), reason))
        if result is not None:
            self.removal.after(*result)


def marks(ctx: StoreContext) -> list[bad_chunks.BadMark]:
    """The bad-chunk marks of the store (for ``quarantine ls`` and reports)."""
    with ctx.index.read() as txn:
        return bad_chunks.scan(txn)


__all__ = ["Repair", "marks"]
