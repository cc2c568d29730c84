"""What every collaborator of a ``Store`` handle shares: one explicit context instead of attributes on a mixin.

Only the state lives here; opening a store (directories, locks, LMDB, the format upgrade) is ``opening.py``, so a
module that imports ``StoreContext`` for a type reaches nothing else of the store.

Why: a collaborator (``liveness``, ``space``, ``save``, ``restore``, ``integrity``, ``admin``) receives the context
plus the other collaborators it calls in its constructor, so what each part needs is stated in code. The context
holds only what is the handle's and not any one part's: where the store is, under which identity it was opened, the
two seams (``index``, ``bytes``), the lease files and the removers' lock, the options, the counters, the handle's
lock, the shared tier and ``access`` (whether this process may write the store: ``liveness/access.py``; an open never
changes the store's permissions, and a store it cannot write opens read-only). ``index`` changes after open (``admin``'s ``replace_index`` swaps the LMDB environment),
``tier`` when one is bound: collaborators read ``ctx.index`` / ``ctx.tier`` at each use and never keep their own
reference.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import KvShelfError
from .results import renamed

if TYPE_CHECKING:  # types only: a collaborator that needs the context for a type reaches no LMDB, lock or file code
    from ..codecs import CodecProvider
    from .identity import Identity
    from .index.protocol import IndexStore
    from .liveness.access import Access
    from .liveness.lease_files import LeaseBook
    from .liveness.removers_lock import RemoversLock
    from .objects.protocol import ByteStore


@dataclass
class Counters:
    """The handle's work counters (tests count work here, never time). Typed fields for the code that counts
    (``ctx.counters.hits += 1``), and a mapping face for what reads them by name: ``store.counters["hits"]``,
    ``dict(store.counters)`` and ``stats()``, which spreads them (``**store.counters``). Keys are the field names;
    no key can be added or removed. Like the dict it replaces, it is not locked: counts of concurrent calls are
    best effort."""

    chunks_read: int = 0
    bytes_read: int = 0
    chunks_written: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    lookups: int = 0
    hits: int = 0
    quarantined: int = 0
    evicted: int = 0
    batch_layers_direct: int = 0
    batch_layers_fallback: int = 0
    chunks_hashed: int = 0
    bytes_hashed: int = 0
    chunks_hash_reused: int = 0
    bytes_hash_reused: int = 0
    chunks_verified: int = 0
    bytes_verified: int = 0

    blobs_read = renamed("blobs_read", "chunks_read")  # deprecated names, one release (docs/API.md, "Renamed")
    blobs_written = renamed("blobs_written", "chunks_written")

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, name: str) -> int:
        if name in _RENAMED:
            return getattr(self, name)  # warns
        if name not in _NAMES:
            raise KeyError(name)
        return getattr(self, name)

    def __setitem__(self, name: str, value: int) -> None:
        if name not in _NAMES:
            raise KeyError(name)
        setattr(self, name, value)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(_NAMES)

    def __contains__(self, name: object) -> bool:
        return name in _NAMES

    def items(self) -> list[tuple[str, int]]:
        return [(name, getattr(self, name)) for name in self.keys()]

    def values(self) -> list[int]:
        return [getattr(self, name) for name in self.keys()]

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in _NAMES else default


_NAMES = frozenset(f.name for f in dataclasses.fields(Counters))
_RENAMED = frozenset({"blobs_read", "blobs_written"})


@dataclass
class StoreContext:
    """One handle's shared state (module docstring). Built by ``opening.open_context`` once the index is open."""

    root: str
    identity: Identity | None  # None: an identity-blind handle for offline tools
    provider: CodecProvider
    index: IndexStore  # replaced only by admin's index swap, under the exclusive hold
    bytes: ByteStore
    leases: LeaseBook  # every handle's lease files (liveness/lease_files.py)
    removers: RemoversLock
    lock_key: str  # the store's identity for the per-process open lock (open_lock.py)
    chunk_tokens: int = 256
    verify_reads: bool = True
    max_bytes: int | None = None
    tenant_max_bytes: dict[str, int] = field(default_factory=dict)  # tenant token -> quota ("*": every tenant's)
    lease_seconds: float = 600.0
    block: int = 16  # prefix records' block size (prefix/hashing.py)
    counters: Counters = field(default_factory=Counters)
    lock: threading.RLock = field(default_factory=threading.RLock)  # the handle's own lock: never held across an
    # index transaction (transaction bodies take it)
    closed: bool = False
    tier: Any = None  # the shared tier (remote/tier.py), bound by open_store(remote=...): restores fall back on it
    keys: Any = None  # the KeyRing (objects/sealing.py) of a store encrypted at rest; None: a plaintext store
    access: Access | None = None  # whether this process may write the store (access.py); None: writable

    @property
    def read_only(self) -> bool:
        return self.access is not None and self.access.read_only

    def check_writable(self, what: str) -> None:
        """``StoreReadOnly`` (naming ``what``, the path and the missing permission) on a read-only handle."""
        if self.access is not None:
            self.access.check(what)

    @property
    def id_key(self) -> bytes | None:
        return self.identity.key if self.identity is not None else None

    @property
    def identity_blind(self) -> bool:
        return self.identity is None

    def check_open(self) -> None:
        if self.closed:
            raise KvShelfError(f"store {self.root} is closed")

    def check_scoped(self, what: str) -> None:
        """Open, and opened under an identity: the identity-scoped calls (save, restore, lookup, sessions, delete)
        refuse on an identity-blind handle instead of seeing every identity's snapshots."""
        self.check_open()
        if self.identity is None:
            raise KvShelfError(f"{what} needs a model identity: this handle on {self.root} was opened identity-blind "
                               f"(admin=True) for offline tools")


__all__ = ["Counters", "StoreContext"]
