"""Moving snapshots in and out of a store as portable single files (``kvshelf export`` / ``import`` / ``watch``).

Import checks the whole file first (``load_snapshot(verify=True)``: header, provider, layouts, identity, every tensor
checksum, codec validation) and only then opens the store, so a bad file leaves nothing behind. It is idempotent:
when the session's latest snapshot already holds exactly these tokens and tensors (compared by checksum of every
tensor), nothing is written. The file's own identity (model, config, tokenizer, namespace) is the one it is filed
under; expected identity fields given by the caller must match it (``IdentityMismatch`` otherwise).

With mlx-lm installed, an mlx-lm ``save_prompt_cache`` file is recognised and goes through
``kvshelf.mlx_lm.files`` (imported lazily: the tools work without mlx-lm): checked completely first as well; it
carries no tokens or identity unless kvshelf wrote it, so the caller gives them (``tokens=``, ``model_id=``).
``export_session(format="mlx-lm")`` writes a file mlx-lm's ``load_prompt_cache`` reads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..codecs import default_provider
from ..codecs.checksum import checksum
from ..codecs.snapshot_args import export_path
from ..codecs.snapshot_file import load_snapshot, save_snapshot
from ..errors import IncompatibleFormat, InvalidCacheState, KvShelfError, SnapshotNotFound, file_error
from .paths import require_path, require_text
from .watcher import FILE_FAULTS, InboxWatcher, WatchStats, env_phase


def _identity_of(header) -> Any:
    from ..store import Identity

    return Identity(header.model_id, config_fingerprint=header.config_fingerprint,
                    tokenizer_hash=header.tokenizer_hash)


def _fingerprint(tokens: Iterable[int], caches: list[Any]) -> tuple[tuple[int, ...], tuple[tuple[str, ...], ...]]:
    """Tokens plus each cache's kind/geometry and the checksum of every tensor: equal iff the snapshots are equal."""
    layers = []
    tokens = list(tokens)
    for cache in caches:
        entry, arrays = default_provider.snapshot(cache, length=len(tokens))
        slots = tuple(f"{s.name}:{s.dtype}:{s.shape}" for s in entry.tensors)
        header = (entry.kind, str(entry.offset), str(entry.minimum_reusable_offset), str(entry.pages))
        layers.append(header + slots + tuple(checksum(a) for a in arrays))
    return tuple(tokens), tuple(layers)


def session_id_for(path: Path) -> str:
    """A file's session id: its name without the ``.safetensors`` suffix (``chat-42.safetensors`` -> ``chat-42``)."""
    name = require_path(path, "snapshot path").name
    return name[: -len(".safetensors")] if name.endswith(".safetensors") else path.stem


def _mlx_lm_files():
    """``kvshelf.mlx_lm.files`` when mlx-lm is installed (tools import the integration lazily), else None."""
    try:
        from ..mlx_lm import files
    except ImportError:
        return None
    return files


def _mlx_lm_identity(path: Path, got: Any, expect: dict[str, str]) -> tuple[Any, str]:
    """The identity and namespace an mlx-lm file is filed under: what kvshelf wrote into it, else the caller's,
    else the file's ``model`` metadata; fields given by both must agree."""
    from ..errors import IdentityMismatch
    from ..store import Identity

    fields = ("model_id", "config_fingerprint", "tokenizer_hash", "namespace")
    stored = dict(got.identity)
    for field in fields:
        if field in stored and field in expect and stored[field] != expect[field]:
            raise IdentityMismatch(field, stored[field], expect[field], f"mlx-lm file {path}")
    merged = {**stored, **expect}
    model_id = merged.get("model_id") or got.metadata.get("model")
    if not model_id:
        raise InvalidCacheState(f"{path}: an mlx-lm file names no model; give --model-id (model_id=...)")
    ident = Identity(model_id, config_fingerprint=merged.get("config_fingerprint", ""),
                     tokenizer_hash=merged.get("tokenizer_hash", ""))
    return ident, merged.get("namespace", "")


def _check_safetensors(path: Path) -> None:
    """``IncompatibleFormat`` when ``path`` is not a safetensors file at all (a text file, a zip, an empty file):
    its first 8 bytes are no header length that fits the file, or the header does not open a JSON object. Why: such
    a file is the wrong file, not a damaged one; ``CorruptData`` is kept for safetensors files whose bytes are bad
    (a truncated tail, a flipped checksum), which the readers below report."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
            size = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise file_error(exc, f"cannot read {path}") from None
    length = int.from_bytes(head[:8], "little") if len(head) >= 8 else None
    if length is None or (length > size - 8 and head[8:9] != b"{"):
        raise IncompatibleFormat(f"{path} is not a safetensors file ({size} bytes, no safetensors header): kvshelf "
                                 "imports kvshelf snapshot files and mlx-lm save_prompt_cache files")


def _import_checked(store_dir, path: Path, session: str, ident: Any, namespace: str, tokens: list[int],
                    caches: list[Any], chunk_tokens: int) -> dict[str, Any]:
    """Save already-verified caches unless the session's latest snapshot holds exactly them."""
    from ..store import open_store

    with open_store(str(store_dir), identity=ident, chunk_tokens=chunk_tokens) as store:
        try:
            current = store.restore(session, namespace=namespace)
        except SnapshotNotFound:
            current = None
        if current is not None and _fingerprint(current.tokens, current.caches) == _fingerprint(tokens, caches):
            return {"file": str(path), "status": "already-present", "session_id": session,
                    "namespace": namespace, "tokens": len(tokens), "bytes_written": 0}
        store.admin.check_writable("import")  # a read-only store refuses under the verb the user ran
        info = store.save(session, tokens, caches, namespace=namespace)
    return {"file": str(path), "status": "imported", "session_id": session, "namespace": namespace,
            "tokens": len(tokens), "snapshot_id": getattr(info, "id", None),
            "bytes_written": getattr(info, "bytes_written", None), "bytes_reused": getattr(info, "bytes_reused", None)}


def import_file(
    store_dir: str | os.PathLike[str], path: str | os.PathLike[str], *, session_id: str | None = None,
    chunk_tokens: int = 256, tokens: Any = None, **expect: str,
) -> dict[str, Any]:
    """Verify ``path`` completely, then save it into the store (unless it is already there). Returns a result dict.

    ``path`` is a kvshelf snapshot file or (with mlx-lm installed) an mlx-lm ``save_prompt_cache`` file; the
    latter carries no tokens unless kvshelf wrote it, so ``tokens`` gives them (refused without)."""
    path, store_dir = require_path(path, "snapshot path"), require_path(store_dir, "store path")
    if session_id is not None:
        require_text(session_id, "session_id")
    session = session_id or session_id_for(path)
    if path.is_file():  # a directory, a FIFO, a missing file: the readers below say so
        _check_safetensors(path)
    files = _mlx_lm_files()
    if files is not None and files.is_prompt_cache_file(path):
        got = files.read_prompt_cache(path, tokens=tokens)
        if got.tokens is None:
            raise InvalidCacheState(f"{path}: this mlx-lm file carries no tokens; give the ids it encodes (--tokens)")
        ident, namespace = _mlx_lm_identity(path, got, expect)
        return {**_import_checked(store_dir, path, session, ident, namespace, got.tokens, got.caches, chunk_tokens),
                "format": "mlx-lm"}
    snap = load_snapshot(path, expect=expect or None, verify=True)
    header = snap.header
    return _import_checked(store_dir, path, session, _identity_of(header), header.namespace, snap.tokens, snap.caches,
                           chunk_tokens)


def import_files(
    store_dir: str | os.PathLike[str], files: Iterable[str | os.PathLike[str]], *, session_id: str | None = None,
    progress: Callable[[int], None] = lambda _n=1: None, chunk_tokens: int = 256, tokens: Any = None, **expect: str,
) -> list[dict[str, Any]]:
    """Import each file; a bad file is reported (status ``failed``) and the others still go in."""
    results = []
    for file in files:
        try:
            results.append(import_file(store_dir, file, session_id=session_id, chunk_tokens=chunk_tokens,
                                       tokens=tokens, **expect))
        except (KvShelfError, OSError) as exc:
            results.append({"file": str(file), "status": "failed", "detail": f"{type(exc).__name__}: {exc}"})
        progress(1)
    return results


def export_session(
    store_dir: str | os.PathLike[str], session_id: str, file: str | os.PathLike[str], *, namespace: str | None = None,
    format: str = "kvshelf", **identity: str,
) -> dict[str, Any]:
    """Write the session's latest snapshot as one portable file (atomic, 0600). Returns what was written.

    ``file`` without a suffix becomes ``file.safetensors`` (the ``file`` returned says so). The file is read back
    by the reader it is meant for before this returns (``load_snapshot`` / mlx-lm's ``load_prompt_cache``); a file
    that does not read back is not kept (``CorruptData``). ``format="mlx-lm"`` writes a file mlx-lm's
    ``load_prompt_cache`` loads (mlx-lm caches, or kvshelf legos with an mlx-lm twin; others are refused with
    ``InvalidCacheState``, and so is a suffix other than ``.safetensors``)."""
    if format not in ("kvshelf", "mlx-lm"):
        raise InvalidCacheState(f"unknown export format {format!r} (kvshelf or mlx-lm)")
    files = _mlx_lm_files() if format == "mlx-lm" else None
    if format == "mlx-lm" and files is None:
        raise InvalidCacheState("--format mlx-lm needs mlx-lm installed (pip install 'kvshelf[mlx-lm]')")
    from . import admin

    require_text(session_id, "session_id")
    require_path(file, "output file")
    file = export_path(file, mlx_lm=format == "mlx-lm")  # NAME -> NAME.safetensors (snapshot_args.export_path)

    with admin.open_admin(store_dir) as store:
        found = admin.find_session(store, session_id, namespace=namespace, **identity)
    from ..store import Identity, open_store

    ident = Identity(found["model_id"], config_fingerprint=found["config_fingerprint"],
                     tokenizer_hash=found["tokenizer_hash"])
    with open_store(str(store_dir), identity=ident) as store:
        restored = store.restore(session_id, namespace=found["namespace"])
        fields = {"model_id": ident.model_id, "config_fingerprint": ident.config_fingerprint,
                  "tokenizer_hash": ident.tokenizer_hash, "namespace": found["namespace"]}
        if files is not None:
            files.write_prompt_cache(file, restored.tokens, restored.caches, identity=fields)  # read back by mlx-lm
        else:
            save_snapshot(file, restored.tokens, restored.caches, identity=fields, read_back=True)
    return {"file": str(file), "session_id": session_id, "namespace": found["namespace"], "format": format,
            "model_id": ident.model_id, "tokens": len(restored.tokens), "bytes": Path(file).stat().st_size}


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
