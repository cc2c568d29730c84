"""Restore destinations backed by transparent huge pages, where the kernel offers them.

Why: a restore's cost on the CPU is mostly page faults — every 4 KiB page of a freshly allocated destination is
faulted (and zeroed by the kernel) as ``preadv`` first writes it: 131,072 faults for a 512 MiB KV cache, about a
third of the restore's CPU time here. ``madvise(MADV_HUGEPAGE)`` on the (still untouched) destination, right
after MLX allocated it and before the first byte is read into it, lets the kernel fault it in 2 MiB pages instead
(measured: restore CPU 371 → 301 ms for 512 MiB on this machine, THP mode ``madvise``). Only the 2 MiB-aligned
interior of a buffer of at least ``MIN_BYTES`` is advised (why not every buffer that holds one aligned 2 MiB page:
tried for issue 32, it cut a KV bf16 prefix restore's page faults 35,873 → 28,724, but its effect on time stayed
inside the run-to-run spread of a shared 2-core machine for both the prefix and the MLA restores, and with
``defrag=madvise`` each advised fault may compact memory synchronously: unproven gain, so not taken);
elsewhere (other systems, THP ``never``, a refused call) this is a no-op, and ``KVSHELF_NO_HUGEPAGES=1`` turns it
off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import numpy as np

HUGE = 2 << 20
MIN_BYTES = 4 * HUGE
MADV_HUGEPAGE = 14  # Linux


def _madvise():
    if not sys.platform.startswith("linux") or os.environ.get("KVSHELF_NO_HUGEPAGES") == "1":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _madvise()


def advise(dest: memoryview) -> bool:
    """Ask for huge pages over the aligned interior of an untouched destination; True when the kernel agreed."""
    if _MADVISE is None or dest.nbytes < MIN_BYTES:
        return False
    addr = np.frombuffer(dest, np.uint8).ctypes.data
    lo = -(-addr // HUGE) * HUGE
    hi = (addr + dest.nbytes) // HUGE * HUGE
    return hi > lo and _MADVISE(lo, hi - lo, MADV_HUGEPAGE) == 0


__all__ = ["MIN_BYTES", "advise"]
