"""xxh3-128 over many runs with the GIL released, so a save's writer thread never waits behind its hash.

Used by ``chunkfile.content_hash`` for chunks of large runs. Restores no longer use it: ``piecereads`` found the
``xxhash`` object faster on cache-hot runs (see its docstring); the history below is why this exists.

Why: a KV piece lands in its destination as H head runs of ``tokens × head_dim × itemsize`` bytes (64 KiB for 256
f16 tokens of dim 128), and the ``xxhash`` package releases the GIL only for inputs over ~100 KiB: the reader threads
of a restore then take turns hashing (measured: two threads hash 64 KiB runs no faster than one), and the hash becomes
a serial ~55 ms per 512 MiB on the restore's critical path. The same package's extension exports the xxHash C API
(``XXH3_createState`` / ``XXH3_128bits_update`` / …); called through ``ctypes`` (which drops the GIL around every
foreign call) it hashes the very same bytes to the very same digest, in parallel. Where the symbols are missing (an
unusual build of ``xxhash``), ``RunHash`` is the plain ``xxhash.xxh3_128`` and only the parallelism is lost.
``tests/store/test_runhash.py`` checks the digests agree with ``xxhash`` for arbitrary inputs and splits.
"""

from __future__ import annotations

import ctypes

import numpy as np
import xxhash


class _XXH128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _load():
    try:
        from xxhash import _xxhash

        lib = ctypes.CDLL(_xxhash.__file__)
        create, free = lib.XXH3_createState, lib.XXH3_freeState
        reset, update, digest = lib.XXH3_128bits_reset, lib.XXH3_128bits_update, lib.XXH3_128bits_digest
    except (ImportError, OSError, AttributeError):
        return None
    create.restype, create.argtypes = ctypes.c_void_p, []
    free.restype, free.argtypes = ctypes.c_int, [ctypes.c_void_p]
    reset.restype, reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
    update.restype, update.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    digest.restype, digest.argtypes = _XXH128, [ctypes.c_void_p]
    return create, free, reset, update, digest


_API = _load()
GATHER_BELOW = 16 << 10  # runs shorter than this are gathered into one contiguous copy before hashing


class RunHash:
    """``xxhash.xxh3_128(prefix)`` fed with ``update(view)``; ``hexdigest()`` as xxhash gives it. Thread-confined:
    one thread at a time feeds one instance (the caller deals pieces to threads by chunk)."""

    __slots__ = ("_state", "_py")

    def __init__(self, prefix: bytes = b""):
        if _API is None:
            self._py, self._state = xxhash.xxh3_128(prefix), None
            return
        self._py = None
        self._state = _API[0]()
        if not self._state:
            raise MemoryError("XXH3_createState failed")
        _API[2](self._state)
        if prefix:
            buf = ctypes.create_string_buffer(prefix, len(prefix))
            _API[3](self._state, ctypes.addressof(buf), len(prefix))

    def update(self, view) -> None:
        if self._py is not None:
            self._py.update(view)
            return
        mv = view if isinstance(view, memoryview) else memoryview(view)
        if mv.nbytes == 0:
            return
        if not mv.c_contiguous:
            raise ValueError("RunHash.update needs a C-contiguous buffer")
        # the address of the first byte, read-only buffers included (MLX exports its arrays read-only), no copy
        addr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, np.uint8).ctypes.data
        _API[3](self._state, addr, mv.nbytes)

    def update_strided(self, region: np.ndarray) -> None:
        """``update`` with ``region``'s bytes in C order, fed run by run from their addresses: no memoryview per
        run (a ``[1, H, t, D]`` window of a larger plane is H runs; making a view of each cost ~6 us of GIL-held
        Python, more than hashing a 64 KiB run, so the pool's threads queued on the GIL instead of hashing)."""
        if region.size == 0:
            return
        if self._py is not None or region.flags["C_CONTIGUOUS"]:
            if region.flags["C_CONTIGUOUS"]:
                self.update(memoryview(region.reshape(-1).view(np.uint8)))
            else:
                self.update(memoryview(np.ascontiguousarray(region).reshape(-1).view(np.uint8)))
            return
        inner, k = region.itemsize, region.ndim
        while k > 0 and (region.shape[k - 1] == 1 or region.strides[k - 1] == inner):
            inner *= region.shape[k - 1]
            k -= 1
        if inner < GATHER_BELOW:  # quantized scales/biases: 1 KiB runs; one small gather beats a call per run
            self.update(memoryview(np.ascontiguousarray(region).reshape(-1).view(np.uint8)))
            return
        offsets = np.zeros(1, dtype=np.int64)
        for d in range(k):
            offsets = (offsets[:, None] + np.arange(region.shape[d], dtype=np.int64) * region.strides[d]).reshape(-1)
        base, state, update = region.ctypes.data, self._state, _API[3]
        for off in offsets.tolist():
            update(state, base + off, inner)

    def hexdigest(self) -> str:
        if self._py is not None:
            return self._py.hexdigest()
        d = _API[4](self._state)
        return f"{d.high64:016x}{d.low64:016x}"

    def __del__(self):
        if getattr(self, "_state", None) and _API is not None:
            _API[1](self._state)
            self._state = None


GIL_FREE = _API is not None

__all__ = ["GIL_FREE", "RunHash"]
