"""The store's save calls as a user makes them: checked, written, made durable, then published.

Why one collaborator: ``save``, ``save_async`` and ``save_checkpoint`` share one order — check the arguments
(``store.inputs``) and the handle (writable, scoped to an identity) before anything is written; write the session's
pack and commit it (``Saver``); grow the full-disk reserve with the longest snapshot (a delete of it must fit on a
full disk); queue it for the shared tier, never waiting — and prefix checkpoints (``checkpoints.py``) come after
their session, whose chunks they share. The façade delegates each call here in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ...errors import SnapshotNotFound
from .. import inputs
from ..context import StoreContext
from ..prefix.hashing import tokens_array
from ..results import SnapshotInfo
from .background import BackgroundWriter
from .checkpoints import CheckpointInfo, Checkpoints
from .saver import Saver


class SessionSaves:
    """``save`` / ``save_async`` / ``save_checkpoint`` / ``list_checkpoints`` / ``flush`` of one handle.
    ``keep_reserve(length)`` is the full disk's (``space/full_disk.py``) and ``manifest(snapshot_id)`` the
    snapshots' (``restore/snapshots.py``): handed in so this room imports neither."""

    def __init__(self, ctx: StoreContext, saver: Saver, writer: BackgroundWriter, checkpoints: Checkpoints,
                 keep_reserve: Callable[[int], None], manifest: Callable[[str], Any]):
        self.ctx, self.saver, self.writer, self.checkpoints = ctx, saver, writer, checkpoints
        self.keep_reserve, self.manifest = keep_reserve, manifest

    def save(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "",
             checkpoints: dict[int, Sequence[Any]] | None = None) -> SnapshotInfo:
        tokens = self._checked("save", session_id, tokens, namespace)
        if checkpoints:
            self.checkpoints.ordered(tokens_array(tokens), checkpoints)  # refused before anything is written
        info = self.published(self.saver.write(self.saver.capture(session_id, tokens, caches, namespace)))
        if checkpoints:  # after the session, so they share its chunks
            self.checkpoints.save_many(session_id, tokens_array(tokens), checkpoints, namespace)
        return info

    def save_async(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "",
                   checkpoints: dict[int, Sequence[Any]] | None = None) -> Future:
        tokens = self._checked("save_async", session_id, tokens, namespace)
        cap = self.saver.capture(session_id, tokens, caches, namespace)
        if not checkpoints:
            return self.writer.submit(lambda: self.published(self.saver.write(cap)), cap.nbytes)
        captured = self.checkpoints.capture_many(session_id, tokens_array(tokens), checkpoints, namespace)

        def write_all() -> SnapshotInfo:  # the session first: its checkpoints share its chunks and need it
            info = self.published(self.saver.write(cap))
            self.checkpoints.write_captured(session_id, namespace, captured)
            return info

        return self.writer.submit(write_all, cap.nbytes + sum(c.nbytes for c in captured))

    def _checked(self, what: str, session_id: str, tokens: Sequence[int], namespace: str):
        """A save's checks, before anything is captured or written: a writable handle, the arguments, an identity."""
        self.ctx.check_writable(what)
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self.ctx.check_scoped(what)
        return tokens

    def save_checkpoint(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any],
                        namespace: str = "") -> SnapshotInfo:
        inputs.check_session(session_id, namespace)
        tokens = inputs.check_tokens(tokens)
        self.ctx.check_scoped("save_checkpoint")
        self.ctx.check_writable("save_checkpoint")
        return self.checkpoints.save(session_id, tokens, caches, namespace)

    def list_checkpoints(self, session_id: str, namespace: str = "") -> list[CheckpointInfo]:
        inputs.check_session(session_id, namespace)
        self.ctx.check_scoped("list_checkpoints")
        return self.checkpoints.listed(session_id, namespace)

    def save_derived(self, derived_id: str, tokens, caches: Sequence[Any], namespace: str) -> SnapshotInfo:
        """A snapshot under a derived id (a prefix checkpoint's): the same write and publish as a session's."""
        return self.published(self.saver.write(self.saver.capture(derived_id, tokens, caches, namespace)))

    def published(self, info: SnapshotInfo) -> SnapshotInfo:
        """Local-durable first; then the reserve grows with the longest snapshot (a delete of it must fit on a full
        disk); then the shared tier (if any) queues it for publishing, never waiting."""
        self.keep_reserve(info.length)
        if self.ctx.tier is not None:
            try:
                self.ctx.tier.saved(self.manifest(info.snapshot_id))
            except SnapshotNotFound:  # already evicted or replaced: nothing to publish
                pass
        return info

    def flush(self) -> None:
        self.writer.flush()


__all__ = ["SessionSaves"]
