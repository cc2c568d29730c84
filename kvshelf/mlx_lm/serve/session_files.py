"""What the session endpoints do to the store: list, export, import, fork and delete one tenant's sessions.

Why its own file: the HTTP side (``session_routes.py``: paths, the admin gate, the tenant, status codes) and the
store side change for different reasons. Every call here gets the store of the serving model and the *namespace of
the request* (``RequestContext.namespace(--cache-namespace)``) and reaches nothing outside it, so a tenant can only
ever name its own sessions: another tenant's session of the same id is simply not there (404).

The file format is the one ``kvshelf export`` writes (``codecs.snapshot_file``: safetensors, a checksummed header,
a checksum per tensor, read back before it is handed out). An import is checked completely before anything is
written (header, identity, every tensor checksum, the codecs), and it is filed under the importing request's
namespace whatever namespace the file names: a file never writes into a scope its sender does not own.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...codecs.snapshot_file import load_snapshot, read_header, save_snapshot
from ...errors import KvShelfError, SnapshotNotFound
from .prompt_cache import session_id_for


class SessionExists(KvShelfError):
    """A fork's target session already exists (the fork would replace it): refused."""


@dataclass(frozen=True)
class Imported:
    session_id: str
    tokens: int
    bytes_written: int
    bytes_reused: int


def _identity_fields(store: Any) -> dict[str, str]:
    ident = store.identity
    return {"model_id": ident.model_id, "config_fingerprint": ident.config_fingerprint,
            "tokenizer_hash": ident.tokenizer_hash}


def listing(store: Any, namespace: str) -> list[dict[str, Any]]:
    """The namespace's sessions, most recently used first (prefix checkpoints are not sessions)."""
    return [{"session_id": s.session_id, "tokens": s.length, "bytes": s.nbytes, "created_at": s.created_at,
             "last_used_at": s.last_used} for s in store.sessions(namespace)]


def export_to(store: Any, namespace: str, session_id: str, directory: str) -> Path:
    """The session's latest snapshot written as a portable file in ``directory`` (read back before it returns).
    ``SnapshotNotFound`` when the namespace has no such session."""
    restored = store.restore(session_id, namespace=namespace)
    path = Path(directory) / "session.safetensors"
    save_snapshot(path, restored.tokens, restored.caches, identity={**_identity_fields(store), "namespace": namespace},
                  read_back=True)
    return path


def import_from(store: Any, namespace: str, path: Path, session_id: str | None) -> Imported:
    """Verify the file completely against the store's model identity (``IdentityMismatch`` for another model's,
    ``CorruptData`` / ``IncompatibleFormat`` for a damaged or foreign file), then save it as ``session_id`` (default:
    the id ``kvshelf serve`` itself gives these tokens, so the server's own write-behinds see it as theirs)."""
    read_header(path)  # a file that is no snapshot at all fails here, before any tensor is read
    snap = load_snapshot(path, expect=_identity_fields(store), verify=True)
    session = session_id or session_id_for(snap.tokens)
    info = store.save(session, snap.tokens, snap.caches, namespace=namespace)
    return Imported(session, len(snap.tokens), int(getattr(info, "bytes_written", 0) or 0),
                    int(getattr(info, "bytes_reused", 0) or 0))


def fork(store: Any, namespace: str, session_id: str, to: str) -> Imported:
    """A new session ``to`` holding the same tokens and caches: saved through the store, whose chunks are content
    hashed, so every chunk is shared with the original and only a manifest is written."""
    if any(s.session_id == to for s in store.sessions(namespace)):
        raise SessionExists(f"fork {session_id!r} -> {to!r}: session {to!r} exists already (delete it first)")
    restored = store.restore(session_id, namespace=namespace)
    info = store.save(to, restored.tokens, restored.caches, namespace=namespace)
    return Imported(to, len(restored.tokens), int(getattr(info, "bytes_written", 0) or 0),
                    int(getattr(info, "bytes_reused", 0) or 0))


def delete(store: Any, namespace: str, session_id: str) -> None:
    """Remove the session (its chunks no other snapshot uses are freed; ``kvshelf gc`` reclaims what is left)."""
    if not any(s.session_id == session_id for s in store.sessions(namespace)):
        raise SnapshotNotFound(f"delete: no session {session_id!r}")
    store.delete(session_id, namespace)


def scratch_dir() -> tempfile.TemporaryDirectory:
    """A private directory for one export or import file (0700, removed afterwards)."""
    return tempfile.TemporaryDirectory(prefix="kvshelf-session-")


__all__ = ["Imported", "SessionExists", "delete", "export_to", "fork", "import_from", "listing", "scratch_dir"]
