"""The store's restore calls as a user makes them: checked, then read straight into MLX arrays by ``Reader``.

Why one collaborator: every restore call first checks its arguments (``store.inputs``) and that the handle is scoped
to an identity, and ``restore_prefix`` is a lookup followed by a restore by id that looks again when the snapshot was
evicted or replaced in between. The façade delegates each call here in one line; ``lookup`` is the prefix room's
(``prefix/lookups.py``), handed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...errors import SnapshotNotFound
from .. import inputs
from ..context import StoreContext
from ..identity import tenant_namespace, tenant_of, tenant_token
from ..results import PrefixHit, Restored, RestoredBatch, SessionInfo
from .reader import Reader
from .snapshots import Snapshots


class Restores:
    """``restore`` / ``restore_snapshot`` / ``restore_prefix`` / ``restore_batch`` / ``sessions`` of one handle."""

    LOOKUP_TRIES = 3  # a snapshot evicted or replaced between lookup and restore: look again, at most this often

    def __init__(self, ctx: StoreContext, reader: Reader, snapshots: Snapshots,
                 lookup: Callable[[Sequence[int], str], PrefixHit | None], uses):
        self.ctx, self.reader, self.snapshots, self.lookup, self.uses = ctx, reader, snapshots, lookup, uses

    def restore(self, session_id: str, namespace: str = "") -> Restored:
        inputs.check_session(session_id, namespace)
        self.ctx.check_scoped("restore")
        return self.reader.restore(session_id, namespace)

    def restore_snapshot(self, snapshot_id: str, length: int | None = None) -> Restored:
        snapshot_id, length = inputs.check_snapshot_id(snapshot_id), inputs.check_length(length)
        self.ctx.check_scoped("restore_snapshot")
        return self.reader.restore_snapshot(snapshot_id, length)

    def restore_prefix(self, prompt_tokens: Sequence[int], namespace: str = "") -> Restored | None:
        prompt_tokens, _ = inputs.check_prompt(prompt_tokens), inputs.check_namespace(namespace)
        for _ in range(self.LOOKUP_TRIES):
            hit = self.lookup(prompt_tokens, namespace)
            if hit is None:
                return None
            try:
                return self.restore_snapshot(hit.snapshot_id, hit.length)
            except SnapshotNotFound:  # evicted or replaced between lookup and restore: look again
                continue
        return None

    def restore_batch(self, requests: Sequence[str | PrefixHit | tuple[str, str]]) -> RestoredBatch:
        inputs.check_requests(requests)
        self.ctx.check_scoped("restore_batch")
        return self.reader.restore_batch(requests)

    def sessions(self, namespace: str | None = None, tenant: str | None = None) -> list[SessionInfo]:
        """``tenant``: only that tenant's sessions; with ``namespace`` None, in every namespace of its scope."""
        inputs.check_optional_namespace(namespace)
        self.ctx.check_scoped("sessions")
        if tenant is None:
            return self.snapshots.sessions(namespace, self.uses.touched())
        if namespace is not None:
            return self.snapshots.sessions(tenant_namespace(namespace, tenant), self.uses.touched())
        token = tenant_token(inputs.check_tenant(tenant))
        return [s for s in self.snapshots.sessions(None, self.uses.touched()) if tenant_of(s.namespace) == token]


__all__ = ["Restores"]
