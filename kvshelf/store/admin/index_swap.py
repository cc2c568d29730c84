"""Holding the store alone and swapping its index: what offline jobs (index compaction, ``rebuild_index``) need.

``exclusive`` makes sure nobody else is in: no other process has the store open (``locks/open.lock``), no other
handle of this process does, no save is in flight (the save gate held exclusively), and this process commits
nothing else meanwhile (the index's writer lock). Only then may the index be replaced, emptied or copied.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ...errors import InvalidCacheState, StoreBusy, file_error
from ..context import StoreContext
from ..index.protocol import DUP_TABLES, PLAIN_TABLES, capability
from ..liveness import open_lock
from ..liveness.save_gate import SaveGate
from ..liveness.transactions import Transactions


class IndexSwap:
    """``flush`` waits for the handle's queued saves (the background writer's ``flush``)."""

    def __init__(self, ctx: StoreContext, gate: SaveGate, txns: Transactions, flush: Callable[[], None]):
        self.ctx, self.gate, self.txns, self.flush = ctx, gate, txns, flush

    @contextmanager
    def exclusive(self, timeout: float = 10.0) -> Iterator[None]:
        """Hold the store alone for an offline job (module docstring). Raises ``StoreBusy`` naming who is in the
        way."""
        ctx = self.ctx
        ctx.check_open()
        self.flush()
        if self.txns.uses.pending:
            self.txns.flush_uses()
        index = ctx.index
        handles = index.users if capability(index, "lmdb_directory") else 1
        if open_lock.users(ctx.lock_key) > 1 or handles > 1:
            raise StoreBusy(f"other store handles in this process have {ctx.root} open")
        try:
            gate = self.gate.hold(exclusive=True, timeout=timeout)
            gate.__enter__()
        except StoreBusy:
            raise StoreBusy(f"saves kept the store at {ctx.root} busy for {timeout:.0f}s") from None
        try:
            with index.writer_lock(), open_lock.exclusive(ctx.lock_key):
                yield
        finally:
            gate.__exit__(None, None, None)

    def replace_index(self, install: Callable[[str], None]) -> None:
        """Inside ``exclusive()``: close the LMDB environment, run ``install(index_dir)``, then open it again."""
        ctx = self.ctx
        ctx.check_open()
        if not open_lock.is_exclusive(ctx.lock_key):
            raise StoreBusy("replace_index needs the store held exclusively (use it inside store.exclusive())")
        index = ctx.index
        if not capability(index, "lmdb_directory"):
            raise InvalidCacheState(f"replace_index swaps an LMDB index directory; this store's index is "
                                    f"{type(index).__name__}")
        path, map_size = index.path, index.map_size()
        index.close()
        try:
            install(path)
        finally:
            ctx.index = index.reopen(map_size)

    def empty_index(self) -> None:
        """Inside ``exclusive()`` (``rebuild_index``): an empty index. LMDB's directory is replaced by a fresh one
        (no page of the old file survives); any other ``IndexStore`` has every table cleared in one transaction."""
        if capability(self.ctx.index, "lmdb_directory"):
            self.replace_index(lambda path: shutil.rmtree(path, ignore_errors=True))
            return
        if not open_lock.is_exclusive(self.ctx.lock_key):
            raise StoreBusy("empty_index needs the store held exclusively (use it inside store.exclusive())")
        self.ctx.index.write(lambda txn: [txn.clear(name) for name in (*PLAIN_TABLES, *DUP_TABLES)])

    def copy_index(self, target: str) -> None:
        """Inside ``exclusive()``: write a compacting copy of the index into directory ``target`` (tools swap it in
        with ``replace_index``)."""
        if not open_lock.is_exclusive(self.ctx.lock_key):
            raise StoreBusy("copy_index needs the store held exclusively (use it inside store.exclusive())")
        index = self.ctx.index
        if not capability(index, "lmdb_directory"):
            raise InvalidCacheState(f"copy_index copies an LMDB index directory; this store's index is "
                                    f"{type(index).__name__}")
        index.copy_to(target)

    def compacted_size(self, work_dir: str) -> int:
        """The size of a compacting copy of the index, written into a fresh directory under ``work_dir`` and
        removed again. Unlike ``copy_index`` it needs no exclusive hold: LMDB copies one read snapshot, and this
        copy is only measured, never swapped in (a copy taken outside the hold and installed later would lose the
        commits made in between — that is what the hold guards). So a dry run works on a store this process may
        only read, with ``work_dir`` outside it."""
        self.ctx.check_open()
        index = self.ctx.index
        if not capability(index, "lmdb_directory"):
            raise InvalidCacheState(f"compacted_size copies an LMDB index directory; this store's index is "
                                    f"{type(index).__name__}")
        try:
            target = tempfile.mkdtemp(prefix="index-size-", dir=work_dir)
        except OSError as exc:
            raise file_error(exc, f"measuring a compacted copy of the index of {self.ctx.root} in {work_dir}") from exc
        try:
            index.copy_to(target)
            return os.stat(os.path.join(target, "data.mdb")).st_size
        finally:
            shutil.rmtree(target, ignore_errors=True)


__all__ = ["IndexSwap"]
