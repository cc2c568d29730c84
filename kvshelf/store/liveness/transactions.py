"""A handle's write transactions: remembered uses first, then the unlinks the transaction decides, then the change.

Every write of a handle goes through ``Transactions.write`` so that the uses it remembers (``uses.py``) and the
pack records its reclaims emptied (``reclaim.py``) ride along with the next commit instead of costing one each. On a
full disk the uses are dropped from the transaction and it is tried once more: an LRU order is never worth a failed
delete or gc.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from ...errors import KvShelfError, StoreFull
from ..context import StoreContext
from .reclaim import Reclaimer
from .uses import UseBook

_T = TypeVar("_T")


class Transactions:
    """One handle's write transactions (owns its ``UseBook``: the book's timer writes through ``flush_uses``)."""

    def __init__(self, ctx: StoreContext, reclaimer: Reclaimer):
        self.ctx, self.reclaimer = ctx, reclaimer
        self.uses = UseBook(ctx, self.flush_uses)

    def write(self, fn: Callable[..., _T], unlink: Sequence[str] = ()) -> _T:
        """One write transaction of this handle: remembered uses first, then unlinking the objects among ``unlink``
        that are dead and unleased (leases read under the writer lock), then ``fn``."""
        touches = self.uses.take()
        forget = self.reclaimer.take_forgotten()

        def run(txn, touches):
            for sid, (when, hashes) in touches.items():
                UseBook.apply(txn, sid, when, hashes)
            self.reclaimer.forget_in(txn, forget)
            if unlink:
                self.reclaimer.unlink_in(txn, unlink)
            return fn(txn)

        try:
            try:
                return self.ctx.index.write(lambda txn: run(txn, touches))
            except StoreFull:
                if not touches:
                    raise
                result = self.ctx.index.write(lambda txn: run(txn, {}))
                touches = {}  # not written, and not worth keeping on a full disk
                return result
        except BaseException:
            self.uses.keep(touches)  # not written: kept for the next transaction
            self.reclaimer.keep_forgotten(forget)
            raise

    def flush_uses(self) -> None:
        """Write the remembered uses now (a transaction with no change of its own)."""
        self.write(lambda txn: None)

    def close(self) -> None:
        """Stop the uses' timer and write what is left (best effort: uses are LRU order only, never data)."""
        self.uses.stop()
        if self.uses.pending:
            try:
                self.flush_uses()
            except KvShelfError:  # damaged records or a full disk
                pass


__all__ = ["Transactions"]
