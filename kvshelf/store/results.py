"""What store calls return: small frozen dataclasses (plain data, no handles)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any


def renamed(old: str, new: str) -> property:
    """A field's name before the store said "chunk" for one thing: deprecated, kept for one release (it warns and
    reads the new field). docs/API.md lists every such name under "Renamed"."""

    def read(self):
        warnings.warn(f"{type(self).__name__}.{old} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(read, doc=f"Deprecated name of ``{new}``.")


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed save: ``bytes_written`` were new chunk bytes, ``bytes_reused`` already stored (deduplicated)."""

    snapshot_id: str
    session_id: str
    length: int
    bytes_written: int
    bytes_reused: int
    minimum_reusable_offset: int
    namespace: str = ""
    chunks_written: int = 0
    chunks_reused: int = 0
    seconds: float = 0.0

    blobs_written = renamed("blobs_written", "chunks_written")
    blobs_reused = renamed("blobs_reused", "chunks_reused")

    @property
    def id(self) -> str:
        return self.snapshot_id


@dataclass(frozen=True)
class Restored:
    """Caches rebuilt for ``tokens`` (``length`` of them); a prefix restore holds the usable prefix only."""

    tokens: list[int]
    caches: list[Any]
    length: int
    session_id: str = ""
    snapshot_id: str = ""
    namespace: str = ""


@dataclass(frozen=True)
class PrefixHit:
    """The longest usable stored prefix of a prompt: restore it with ``restore_prefix`` or ``restore_batch``."""

    session_id: str
    snapshot_id: str
    length: int
    namespace: str = ""
    snapshot_length: int = 0
    checkpoint: bool = False  # served from one of the session's checkpoints (docs/CHECKPOINTS.md)


@dataclass(frozen=True)
class RestoredBatch:
    """One batched cache per layer, rows in request order (left zero padding, ``row_offsets`` set)."""

    caches: list[Any]
    lengths: list[int]
    tokens: list[list[int]]


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    namespace: str
    snapshot_id: str
    length: int
    nbytes: int
    created_at: float
    last_used: float


@dataclass(frozen=True)
class Finding:
    """One inconsistency ``verify`` found: ``kind`` (e.g. ``missing-chunk``), where, and what is wrong."""

    kind: str
    where: str
    detail: str
    sessions: tuple[str, ...] = ()  # the session ids it affects, where the index still says


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or, with ``dry_run``, would remove)."""

    dry_run: bool
    orphan_objects: list[str] = field(default_factory=list)
    orphan_manifests: list[str] = field(default_factory=list)
    tmp_files: list[str] = field(default_factory=list)
    expired_leases: int = 0
    bytes: int = 0
    skipped: str = ""
    tombstones: list[str] = field(default_factory=list)  # tomb/<sid> files no manifest on disk needs any more

    orphan_blobs = renamed("orphan_blobs", "orphan_objects")


__all__ = ["renamed", "SnapshotInfo", "Restored", "PrefixHit", "RestoredBatch", "SessionInfo", "Finding", "GcReport"]


@dataclass(frozen=True)
class RepairReport:
    """What ``repair`` did (or, with ``dry_run``, would do): the snapshots lost (each used a chunk with no good copy;
    its session, namespace and those chunks), the quarantined snapshots whose records it dropped, the damaged
    chunks, those healed from a good copy (another pack or the shared tier; with where it came from), what ``gc`` reclaimed and any damage still found afterwards (empty when the store is clean)."""

    dry_run: bool
    lost: list[dict] = field(default_factory=list)
    dropped_quarantined: list[dict] = field(default_factory=list)
    bad_chunks: list[str] = field(default_factory=list)
    dropped_checkpoints: list[str] = field(default_factory=list)  # snapshot ids of checkpoints whose session is gone
    healed: list[dict] = field(default_factory=list)  # damaged chunks rewritten from a good copy: chunk, source, sessions
    rewritten_trailers: list[str] = field(default_factory=list)  # packs rewritten under fresh trailers
    reclaimed_bytes: int = 0
    reclaimed_objects: int = 0
    remaining: list[str] = field(default_factory=list)


__all__ += ["RepairReport"]
