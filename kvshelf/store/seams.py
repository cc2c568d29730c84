"""The write-fault seam every byte-store write goes through (``LocalByteStore.put``), where tests make a disk full.

Set ``FAULT_HOOK`` (in-process: called as ``FAULT_HOOK(path, nbytes)`` before each write; may raise
``OSError(ENOSPC, ...)``) or the environment variable ``KVSHELF_FAULT_ENOSPC_AFTER`` (a byte count; useful in
subprocesses) to make writes fail as a full disk would. (Layout v1's one-file-per-chunk ``LocalBlobStore`` lived
here; v1 files are now read through the byte store: ``keys.legacy_blob``.)
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

FAULT_HOOK: Callable[[str, int], None] | None = None
_written_by_process = 0


def _inject_faults(path: str, nbytes: int) -> None:
    global _written_by_process
    if FAULT_HOOK is not None:
        FAULT_HOOK(path, nbytes)
    limit = os.environ.get("KVSHELF_FAULT_ENOSPC_AFTER")
    if limit is not None and _written_by_process + nbytes > int(limit):
        raise OSError(errno.ENOSPC, "No space left on device (injected by KVSHELF_FAULT_ENOSPC_AFTER)", path)
    _written_by_process += nbytes


__all__ = ["FAULT_HOOK"]
