"""The store's calls that decide what it keeps: deleting a session, pinning one against eviction.

Why together: each is an operator's or a user's decision about one session's place in the store's space, checked
the same way (``store.inputs``; a writable handle) before the room that carries it out acts: ``FullDisk.delete``
(works on a full disk) and ``Pins``. ``drop_checkpoint_records(txn, session_key)`` is the prefix checkpoints' (a
delete also drops its checkpoints' quarantine records), handed in so this room does not import ``save``.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import inputs
from ..context import StoreContext
from .full_disk import FullDisk
from .pins import Pins


class Keeping:
    """``delete`` / ``pin`` / ``unpin`` of one handle (the façade delegates each in one line)."""

    def __init__(self, ctx: StoreContext, full_disk: FullDisk, pins: Pins,
                 session_key: Callable[[str, str], bytes], drop_checkpoint_records: Callable[[object, bytes], int]):
        self.ctx, self.full_disk, self.pins = ctx, full_disk, pins
        self.session_key, self.drop_checkpoint_records = session_key, drop_checkpoint_records

    def delete(self, session_id: str, namespace: str = "") -> None:
        self.ctx.check_writable("delete")
        inputs.check_session(session_id, namespace)
        self.ctx.check_scoped("delete")
        skey = self.session_key(session_id, namespace)
        self.full_disk.delete(skey, session_id, namespace,
                              also=lambda txn: self.drop_checkpoint_records(txn, skey))  # its checkpoints' records

    def pin(self, session_id: str, namespace: str = "", ttl: float | None = None):
        self.ctx.check_writable("pin")
        inputs.check_session(session_id, namespace)
        self.ctx.check_open()
        return self.pins.pin(session_id, namespace, ttl)

    def unpin(self, session_id: str, namespace: str = "") -> bool:
        self.ctx.check_writable("unpin")
        inputs.check_session(session_id, namespace)
        self.ctx.check_open()
        return self.pins.unpin(session_id, namespace)


__all__ = ["Keeping"]
