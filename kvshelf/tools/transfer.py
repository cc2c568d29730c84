"""Moving snapshots in and out of a store as portable single files (``kvshelf export`` / ``import`` / ``watch``).

Import checks the whole file first (``load_snapshot(verify=True)``: header, provider, layouts, identity, every tensor
checksum, codec validation) and only then opens the store, so a bad file leaves nothing behind. It is idempotent:
when the session's latest snapshot already holds exactly these tokens and tensors (compared by checksum of every
tensor), nothing is written. The file's own identity (model, config, tokenizer, namespace) is the one it is filed
under; expected identity fields given by the caller must match it (``IdentityMismatch`` otherwise).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..codecs import default_provider
from ..codecs.checksum import checksum
from ..codecs.snapshot_file import load_snapshot, save_snapshot
from ..errors import KvShelfError, SnapshotNotFound
from .paths import require_path, require_text
from .watcher import FILE_FAULTS, InboxWatcher, WatchStats, env_phase


def _identity_of(header) -> Any:
    from ..store import Identity

    return Identity(header.model_id, config_fingerprint=header.config_fingerprint,
                    tokenizer_hash=header.tokenizer_hash)


def _fingerprint(tokens: Iterable[int], caches: list[Any]) -> tuple[tuple[int, ...], tuple[tuple[str, ...], ...]]:
    """Tokens plus each cache's kind/geometry and the checksum of every tensor: equal iff the snapshots are equal."""
    layers = []
    for cache in caches:
        entry, arrays = default_provider.snapshot(cache)
        slots = tuple(f"{s.name}:{s.dtype}:{s.shape}" for s in entry.tensors)
        header = (entry.kind, str(entry.offset), str(entry.minimum_reusable_offset), str(entry.pages))
        layers.append(header + slots + tuple(checksum(a) for a in arrays))
    return tuple(tokens), tuple(layers)


def session_id_for(path: Path) -> str:
    """A file's session id: its name without the ``.safetensors`` suffix (``chat-42.safetensors`` -> ``chat-42``)."""
    name = require_path(path, "snapshot path").name
    return name[: -len(".safetensors")] if name.endswith(".safetensors") else path.stem


def import_file(
    store_dir: str | os.PathLike[str], path: str | os.PathLike[str], *, session_id: str | None = None,
    chunk_tokens: int = 256, **expect: str,
) -> dict[str, Any]:
    """Verify ``path`` completely, then save it into the store (unless it is already there). Returns a result dict."""
    from ..store import open_store

    path, store_dir = require_path(path, "snapshot path"), require_path(store_dir, "store path")
    if session_id is not None:
        require_text(session_id, "session_id")
    snap = load_snapshot(path, expect=expect or None, verify=True)
    header = snap.header
    session = session_id or session_id_for(path)
    with open_store(str(store_dir), identity=_identity_of(header), chunk_tokens=chunk_tokens) as store:
        try:
            current = store.restore(session, namespace=header.namespace)
        except SnapshotNotFound:
            current = None
        if current is not None and _fingerprint(current.tokens, current.caches) == _fingerprint(snap.tokens, snap.caches):
            return {"file": str(path), "status": "already-present", "session_id": session,
                    "namespace": header.namespace, "tokens": len(snap.tokens), "bytes_written": 0}
        info = store.save(session, snap.tokens, snap.caches, namespace=header.namespace)
    return {"file": str(path), "status": "imported", "session_id": session, "namespace": header.namespace,
            "tokens": len(snap.tokens), "snapshot_id": getattr(info, "id", None),
            "bytes_written": getattr(info, "bytes_written", None), "bytes_reused": getattr(info, "bytes_reused", None)}


def import_files(
    store_dir: str | os.PathLike[str], files: Iterable[str | os.PathLike[str]], *, session_id: str | None = None,
    progress: Callable[[int], None] = lambda _n=1: None, chunk_tokens: int = 256, **expect: str,
) -> list[dict[str, Any]]:
    """Import each file; a bad file is reported (status ``failed``) and the others still go in."""
    results = []
    for file in files:
        try:
            results.append(import_file(store_dir, file, session_id=session_id, chunk_tokens=chunk_tokens, **expect))
        except (KvShelfError, OSError) as exc:
            results.append({"file": str(file), "status": "failed", "detail": f"{type(exc).__name__}: {exc}"})
        progress(1)
    return results


def export_session(
    store_dir: str | os.PathLike[str], session_id: str, file: str | os.PathLike[str], *, namespace: str | None = None,
    **identity: str,
) -> dict[str, Any]:
    """Write the session's latest snapshot as one portable file (atomic, 0600). Returns what was written."""
    from . import admin

    require_text(session_id, "session_id")
    require_path(file, "output file")

    with admin.open_admin(store_dir) as store:
        found = admin.find_session(store, session_id, namespace=namespace, **identity)
    from ..store import Identity, open_store

    ident = Identity(found["model_id"], config_fingerprint=found["config_fingerprint"],
                     tokenizer_hash=found["tokenizer_hash"])
    with open_store(str(store_dir), identity=ident) as store:
        restored = store.restore(session_id, namespace=found["namespace"])
        header = save_snapshot(file, restored.tokens, restored.caches,
                               identity={"model_id": ident.model_id, "config_fingerprint": ident.config_fingerprint,
                                         "tokenizer_hash": ident.tokenizer_hash, "namespace": found["namespace"]})
    return {"file": str(file), "session_id": session_id, "namespace": found["namespace"],
            "model_id": ident.model_id, "tokens": len(header.tokens), "bytes": Path(file).stat().st_size}


def watch_inbox(
    store_dir: str | os.PathLike[str], inbox: str | os.PathLike[str], *, settle: float = 1.0,
    compact_every: float | None = None, until_idle: float | None = None, log: Callable[[str], None] = print,
    poll: float = 0.25, chunk_tokens: int = 256, **expect: str,
) -> WatchStats:
    """Run the inbox watcher until SIGINT/SIGTERM (or idle for ``until_idle`` seconds)."""
    require_path(store_dir, "store path")
    inbox = require_path(inbox, "inbox")

    def ingest(path: Path) -> dict[str, Any]:
        return import_file(store_dir, path, chunk_tokens=chunk_tokens, **expect)

    compact = None
    if compact_every is not None:
        def compact() -> None:
            from . import admin
            from .compaction import compact as run_compaction

            started = time.monotonic()
            with admin.open_admin(store_dir) as store:
                report = run_compaction(store)
            log(f"compacted: {report.bytes_before} -> {report.bytes_after} bytes in {time.monotonic() - started:.1f}s")

    watcher = InboxWatcher(inbox, ingest, settle=settle, poll=poll, compact=compact, compact_every=compact_every,
                           log=log, phase=env_phase())
    watcher.install_signal_handlers()
    return watcher.run(until_idle=until_idle)


__all__ = ["import_file", "import_files", "export_session", "watch_inbox", "session_id_for", "FILE_FAULTS"]
