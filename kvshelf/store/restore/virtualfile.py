"""What ``mx.load`` reads on a restore: a safetensors header describing the destinations, tensor bytes on demand.

Why: MLX has no way to hand out an owned, uninitialised, writable buffer; ``mx.load`` of a file-like object
allocates each tensor uninitialised and fills it with ONE ``readinto(memoryview)`` into its own buffer. So the
restore describes its destinations as a header and fills each tensor inside that call (``fill(slot, view)``).
Errors raised inside ``readinto`` are kept (``error``) and re-raised by the caller after ``mx.eval`` returns:
nothing may unwind through MLX, and the arrays of a failed read are dropped, never returned.
"""

from __future__ import annotations

import json
import struct

from ...codecs.dtypes import safetensors_code
from ...errors import KvShelfError


class VirtualFile:
    """What ``mx.load`` reads: a safetensors header of the destinations; tensor bytes made on demand."""

    closed = False

    def __init__(self, slots: list, fill):
        header, off = {}, 0
        self.at: dict[int, object] = {}
        for s in slots:
            header[s.key] = {"dtype": safetensors_code(s.dtype), "shape": list(s.shape),
                             "data_offsets": [off, off + s.nbytes]}
            self.at[off] = s
            off += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.head = struct.pack("<Q", len(raw)) + raw
        self.size = len(self.head) + off
        self.pos = 0
        self.fill = fill
        self.error: BaseException | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        buf = bytearray(self.size - self.pos if n is None or n < 0 else n)
        k = self.readinto(buf)
        return bytes(buf[:k])

    def readinto(self, buf) -> int:
        mv = memoryview(buf).cast("B")
        n = mv.nbytes
        try:
            if self.pos < len(self.head):
                k = min(n, len(self.head) - self.pos)
                mv[:k] = self.head[self.pos:self.pos + k]
                if k < n:
                    raise KvShelfError("unexpected read across the header boundary")
            else:
                slot = self.at.get(self.pos - len(self.head))
                if slot is None or slot.nbytes != n:
                    raise KvShelfError(f"MLX asked for {n} bytes at {self.pos}: not one whole destination tensor")
                if self.error is None:
                    self.fill(slot, mv)
        except BaseException as exc:  # kept, re-raised after eval: never let it unwind through MLX
            if self.error is None:
                self.error = exc
        self.pos += n
        return n


__all__ = ["VirtualFile"]
