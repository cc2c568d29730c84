"""The store's test seams, all in one place and one style: a ``Seam`` is a list of callables that the store runs at
one named point (``SEAM(*args)``); outside tests every seam is empty and costs a truth test.

A test adds a callable (``seams.BEFORE_OPEN.append(fn)``) and takes it away (``.remove(fn)``, ``.clear()``); the
callable may raise (a full disk) or block (to hold a race open at exactly that point), so races are tested by
events, never by timing. The write-fault seam also has a form for subprocesses: the environment variable
``KVSHELF_FAULT_ENOSPC_AFTER`` (a byte count) makes writes past it fail as a full disk would.
"""

from __future__ import annotations

import errno
import os


class Seam(list):
    """One named point where tests run code: call it with the point's arguments; runs every callable in order."""

    def __init__(self, doc: str) -> None:
        super().__init__()
        self.doc = doc

    def __call__(self, *args) -> None:
        for fn in tuple(self):
            fn(*args)

    def __repr__(self) -> str:
        return f"Seam({self.doc!r}, {list.__repr__(self)})"


FAULT_HOOK = Seam("before each byte-store write, (path, nbytes); may raise OSError(ENOSPC) as a full disk would")
BEFORE_OPEN = Seam("a reader found a chunk's object name and is about to open it, (name)")
BEFORE_UNLINK = Seam("a remover committed its drop and is about to unlink what it freed, ()")
AFTER_BATCH = Seam("verify read one batch of manifests and is about to read the next, ()")
BEFORE_CONFIRM = Seam("verify is about to confirm its crash-residue candidates, ()")
PUBLISH_HOOK = Seam("the shared tier uploaded one chunk, (chunk hash)")
FETCH_HOOK = Seam("the shared tier fetched one batch of chunks, (batch index)")

_written_by_process = 0


def _inject_faults(path: str, nbytes: int) -> None:
    """Every byte-store write passes here first (``objects/local.py``)."""
    global _written_by_process
    FAULT_HOOK(path, nbytes)
    limit = os.environ.get("KVSHELF_FAULT_ENOSPC_AFTER")
    if limit is not None and _written_by_process + nbytes > int(limit):
        raise OSError(errno.ENOSPC, "No space left on device (injected by KVSHELF_FAULT_ENOSPC_AFTER)", path)
    _written_by_process += nbytes


__all__ = ["AFTER_BATCH", "BEFORE_CONFIRM", "BEFORE_OPEN", "BEFORE_UNLINK", "FAULT_HOOK", "FETCH_HOOK", "PUBLISH_HOOK",
           "Seam"]
