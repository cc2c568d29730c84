"""The offline tools' view of a store: every identity and namespace at once, read from manifests and chunk records.

A :class:`~kvshelf.store.Store` is normally opened under one identity (serving processes only ever see their own
model); operators need to see everything. ``open_admin`` opens it identity-blind (``open_store(path, admin=True)``) and
uses only the store's documented tools surface (``iter_manifests``, ``manifest``, ``summaries``, ``iter_chunks``,
``chunk_info``, ``leased_hashes``, ``verify``, ``gc``, ``rebuild_index``).
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from ..errors import CorruptData, IncompatibleFormat, KvShelfError, SnapshotNotFound, file_error
from ..store import Store, StoreBusy, open_store, read_key_file
from ..store.identity import identity_key
from ..store.index import Manifest, is_checkpoint, parent_of
from . import lmdb_files
from .paths import KEY_FILE_VAR, require_path, require_text

_SNAPSHOT_ID = re.compile(r"^[0-9a-f]{32}$")
IDENTITY_FIELDS = ("model_id", "config_fingerprint", "tokenizer_hash", "namespace")


class StoreMissing(KvShelfError, FileNotFoundError):
    """No store at the given directory (and the command does not create one)."""


def is_store(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a store's index; ``FileAccessError`` when this process may not even look."""
    try:
        return (Path(path) / "index" / "data.mdb").is_file()
    except OSError as exc:
        raise file_error(exc, f"cannot open the store at {path}") from None


@contextmanager
def open_admin(path: str | os.PathLike[str], *, create: bool = False) -> Iterator[Store]:
    """The store at ``path`` opened for offline tools. Raises ``StoreMissing`` unless it exists or ``create``."""
    path = require_path(path, "store path")
    if not create and not is_store(path):
        raise StoreMissing(f"no kvshelf store at {path} (expected {Path(path) / 'index' / 'data.mdb'}); "
                           f"pass --store DIR or set KVSHELF_STORE")
    store = open_store(str(path), admin=True, key=_env_key())
    try:
        yield store
    finally:
        store.close()


def _env_key() -> bytes | str | None:
    """The key of ``--encryption-key-file`` (the CLI puts it in the environment): an encrypted store's chunks read."""
    key_file = os.environ.get(KEY_FILE_VAR)
    return read_key_file(key_file) if key_file else None


def _matches(m: Manifest, filters: dict[str, str | None]) -> bool:
    return all(value is None or getattr(m, field) == value for field, value in filters.items())


def manifests(store: Store, **filters: str | None) -> list[Manifest]:
    return [m for m in store.admin.iter_manifests() if _matches(m, filters)]


def _last_used(store: Store) -> dict[str, float]:
    """Snapshot id -> last use (seconds), from the store's identity-blind summaries."""
    return {sid: summary.last_used_ns / 1e9 for sid, summary in store.admin.summaries().items()}


def format_of(entry: dict[str, Any]) -> str:
    """A cache entry's storage format as ``f32`` / ``affine:4:64`` / ``turbo:8:3`` (paged entries say so)."""
    if entry.get("bits") is not None:
        fmt = f"affine:{entry['bits']}:{entry.get('group_size')}"
    elif entry.get("k_bits") is not None:
        fmt = f"turbo:{entry['k_bits']}:{entry.get('v_bits')}"
    else:
        tensors = entry.get("tensors") or []
        fmt = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(tensors[0]["dtype"] if tensors else "",
                                                                         "f32")
    return fmt + ("+shadow" if entry.get("shadow") else "")


def list_sessions(store: Store, **filters: str | None) -> list[dict[str, Any]]:
    """One row per stored session (its latest snapshot), every identity unless filtered; newest use first."""
    chunks = dict(store.admin.iter_chunks())
    used = _last_used(store)
    pins = {(p.session_key[:16], p.namespace, p.session_id): p.expires_at for p in store.pins.listing()}
    rows = []
    every = list(manifests(store, **filters))
    held = _checkpoints_by_session(every)
    for m in every:
        if is_checkpoint(m.session_id):  # listed with its session (store/save/checkpoints.py)
            continue
        own = shared = 0
        for ref in {r.hash: r for r in m.all_chunks}.values():
            meta = chunks.get(ref.hash)
            if meta is not None and meta.refs > 1:
                shared += ref.nbytes
            else:
                own += ref.nbytes
        entries = [msgspec.to_builtins(e) for e in m.entries]
        rows.append({
            "session_id": m.session_id, "snapshot_id": m.snapshot_id, "namespace": m.namespace,
            "model_id": m.model_id, "config_fingerprint": m.config_fingerprint, "tokenizer_hash": m.tokenizer_hash,
            "tokens": m.length, "bytes_own": own, "bytes_shared": shared, "created_at": m.created_at,
            "last_used_at": used.get(m.snapshot_id), "minimum_reusable_offset": m.minimum_reusable_offset,
            "kinds": sorted({e["kind"] for e in entries}), "formats": sorted({format_of(e) for e in entries}),
            "pinned": (key := (identity_key(m.model_id, m.config_fingerprint, m.tokenizer_hash), m.namespace,
                               m.session_id)) in pins,
            "pin_expires_at": pins.get(key),
            "checkpoints": [c["tokens"] for c in held.get(_scope(m), [])],
        })
    rows.sort(key=lambda r: -(r["last_used_at"] or 0.0))
    return rows


def _scope(m: Manifest) -> tuple:
    return (m.model_id, m.config_fingerprint, m.tokenizer_hash, m.namespace, m.session_id)


def _checkpoints_by_session(ms: list[Manifest]) -> dict[tuple, list[dict[str, Any]]]:
    """Each session's checkpoints (tokens, snapshot id, bytes referenced), by length."""
    out: dict[tuple, list[dict[str, Any]]] = {}
    for m in ms:
        parent = parent_of(m.session_id)
        if parent is not None:
            key = (m.model_id, m.config_fingerprint, m.tokenizer_hash, m.namespace, parent[0])
            out.setdefault(key, []).append({"tokens": m.length, "snapshot_id": m.snapshot_id, "nbytes": m.nbytes})
    for rows in out.values():
        rows.sort(key=lambda r: r["tokens"])
    return out


def resolve(store: Store, target: str, **filters: str | None) -> Manifest:
    """A snapshot id, or a session id (its latest snapshot) that the filters make unambiguous."""
    require_text(target, "session or snapshot id")
    if _SNAPSHOT_ID.match(target):
        try:
            m = store.admin.manifest(target)
            if _matches(m, filters):
                return m
        except SnapshotNotFound:
            pass
    found = [m for m in manifests(store, **filters) if m.session_id == target]
    if not found:
        raise SnapshotNotFound(f"no session or snapshot {target!r} in the store at {store.root}"
                               + (f" matching {_describe(filters)}" if any(filters.values()) else ""))
    if len(found) > 1:
        scopes = "; ".join(f"model_id={m.model_id!r} namespace={m.namespace!r}" for m in found)
        raise KvShelfError(f"session {target!r} exists under several identities/namespaces ({scopes}); "
                           f"narrow it with --model-id/--namespace or give the snapshot id")
    return found[0]


def _describe(filters: dict[str, str | None]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in filters.items() if v is not None)


def find_session(store: Store, session_id: str, **filters: str | None) -> dict[str, str]:
    m = resolve(store, session_id, **filters)
    return {f: getattr(m, f) for f in IDENTITY_FIELDS} | {"snapshot_id": m.snapshot_id}


def delete_session(path: str | os.PathLike[str], session_id: str, **filters: str | None) -> dict[str, Any]:
    """``kvshelf delete SESSION``: the session the filters make unambiguous (every identity and namespace is
    searched, as ``kvshelf export`` does), deleted through a handle opened under its own identity (deleting is an
    identity-scoped call). ``SnapshotNotFound`` when no session has that id."""
    require_text(session_id, "session_id")
    with open_admin(path) as store:
        m = resolve(store, session_id, **filters)  # the one session (or snapshot) the filters name, else a clear error
    from ..store import Identity

    ident = Identity(m.model_id, config_fingerprint=m.config_fingerprint, tokenizer_hash=m.tokenizer_hash)
    with open_store(str(path), identity=ident, key=_env_key()) as store:
        store.delete(m.session_id, m.namespace)
    return {"session_id": m.session_id, "namespace": m.namespace, "model_id": m.model_id,
            "snapshot_id": m.snapshot_id, "tokens": m.length}


def show(store: Store, target: str, **filters: str | None) -> dict[str, Any]:
    """The header of one snapshot (from its manifest: no tensor is read) and its chunks with their encodings."""
    m = resolve(store, target, **filters)
    doc = msgspec.to_builtins(m)
    tokens = doc.pop("tokens")
    doc["tokens"] = len(tokens)
    doc["token_ids_head"] = tokens[:16]
    doc["caches"] = doc.pop("entries")
    chunks = []
    for kind, refs in (("chunk", m.chunks), ("untokened", m.own)):
        for ref in refs:
            meta = store.admin.chunk_info(ref.hash)
            chunks.append({"hash": ref.hash, "start": ref.start, "stop": ref.stop, "nbytes": ref.nbytes,
                           "stored_bytes": None if meta is None else meta.stored_bytes,
                           "encoding": None if meta is None else meta.encoding,
                           "refs": None if meta is None else meta.refs, "kind": kind})
    doc["chunks"] = chunks
    doc.pop("own", None)
    if not is_checkpoint(m.session_id):  # the session's checkpoints (store/save/checkpoints.py)
        doc["checkpoints"] = _checkpoints_by_session(
            [c for c in store.admin.iter_manifests(skip_damaged=True)
             if c.namespace == m.namespace and c.session_id.startswith(m.session_id)]).get(_scope(m), [])
    return doc


def chunk_totals(store: Store) -> dict[str, int]:
    """Payload and on-disk bytes of every indexed chunk, and how many are compressed."""
    payload = stored = zstd = count = 0
    for _h, meta in store.admin.iter_chunks():
        count += 1
        payload += meta.nbytes
        stored += meta.stored_bytes
        zstd += meta.encoding == "zstd"
    return {"chunks": count, "payload_bytes": payload, "stored_bytes": stored, "compressed_chunks": zstd}


def orphans(store: Store) -> dict[str, int]:
    """Object and manifest files no index record references (leased chunks of live readers excluded)."""
    found = store.admin.orphans()
    objects = [size for _name, kind, size in found if kind == "orphan-object"]
    files = [name for name, kind, _size in found if kind == "orphan-manifest"]
    return {"orphan_count": len(objects), "orphan_bytes": sum(objects), "orphan_manifests": len(files)}


def stats(store: Store, max_bytes: int | None = None) -> dict[str, Any]:
    """Totals over the whole store: deduplication ratio = bytes the snapshots reference / distinct payload bytes;
    compression ratio = distinct payload bytes / bytes on disk."""
    ms = list(store.admin.iter_manifests())
    totals = chunk_totals(store)
    logical = sum(m.nbytes for m in ms)
    identities = Counter((m.model_id, m.config_fingerprint, m.tokenizer_hash) for m in ms)
    doc: dict[str, Any] = {
        "store": store.root,
        "snapshots": len(ms),
        "sessions": len({(m.model_id, m.config_fingerprint, m.tokenizer_hash, m.namespace, m.session_id)
                         for m in ms if not is_checkpoint(m.session_id)}),
        "checkpoints": sum(1 for m in ms if is_checkpoint(m.session_id)),
        "identities": len(identities),
        "namespaces": len({m.namespace for m in ms}),
        "tokens": sum(m.length for m in ms),
        "referenced_bytes": logical,
        **totals,
        "dedup_ratio": round(logical / totals["payload_bytes"], 4) if totals["payload_bytes"] else 1.0,
        "compression_ratio": round(totals["payload_bytes"] / totals["stored_bytes"], 4)
        if totals["stored_bytes"] else 1.0,
        "index_bytes": lmdb_files.index_bytes(store.root),
        "max_bytes": max_bytes,
        "budget_use": round(totals["stored_bytes"] / max_bytes, 4) if max_bytes else None,
        "pinned_bytes": store.pins.pinned_bytes(),
        **orphans(store),
    }
    return doc


def _snapshot_in(where: str) -> str:
    match = re.search(r"snapshot ([0-9a-f]{32})", where)
    return match.group(1) if match else ""


def _affected(store: Store, where: str) -> list[tuple[str, str]]:
    """(session, snapshot) pairs a finding's ``where`` touches: the snapshot it names or the users of a chunk."""
    match = re.search(r"snapshot ([0-9a-f]{32})", where)
    if match:
        try:
            m = store.admin.manifest(match.group(1))
            return [(m.session_id, m.snapshot_id)]
        except (SnapshotNotFound, CorruptData, IncompatibleFormat):
            return [("", match.group(1))]
    match = re.search(r"chunk ([0-9a-f]{32})", where)
    if match:
        users = [(m.session_id, m.snapshot_id) for m in store.admin.iter_manifests(skip_damaged=True)
                 if any(r.hash == match.group(1) for r in m.all_chunks)]
        return users or [("", "")]
    return [("", "")]


def _header_findings(store: Store) -> list[dict[str, Any]]:
    """Each manifest's cache entries against their codecs, and its chunk list against its length."""
    from ..codecs import default_provider

    out = []
    for m in store.admin.iter_manifests(skip_damaged=True):  # a damaged record is the store's own finding
        def problem(text: str, m=m) -> None:
            out.append({"kind": "bad-header", "where": f"snapshot {m.snapshot_id}", "detail": text,
                        "session_id": m.session_id, "snapshot_id": m.snapshot_id,
                        "message": f"bad-header: {text}"})

        try:
            default_provider.check_provider(m.provider)
        except IncompatibleFormat as exc:
            problem(str(exc))
            continue
        for i, e in enumerate(m.entries):
            try:
                default_provider.for_entry(e).validate(e, i)
            except KvShelfError as exc:
                problem(f"entry {i}: {exc}")
            if e.offset != m.length:
                problem(f"entry {i} ({e.kind}) offset {e.offset} but the snapshot has {m.length} tokens")
        pos = 0
        for ref in m.chunks:
            if ref.start != pos or ref.stop <= ref.start:
                problem(f"chunk {ref.hash} covers [{ref.start}, {ref.stop}), expected to start at {pos}")
                break
            pos = ref.stop
        else:
            if m.chunks and pos != m.length:
                problem(f"chunks cover [0, {pos}) but the snapshot has {m.length} tokens")
    return out


# Findings that need no operator: the damage was already handled and nothing is lost. An orphan object or manifest
# is what a heal (a damaged chunk re-written under a fresh pack by the next save), a re-save, a quarantine drop or a
# crash leaves behind: no index record names it, so no session reads it, and `kvshelf gc` reclaims it. A quarantined
# snapshot is already out of service (no lookup returns it; the next save of its conversation writes it afresh);
# its bytes are kept as evidence until `kvshelf repair` or `quarantine drop`. Everything else (a damaged chunk a
# live snapshot still uses, a drifted count, a damaged trailer, an unreadable index) needs an operator.
HANDLED_KINDS = frozenset({"orphan-object", "orphan-manifest", "quarantined"})


def verify(store: Store, deep: bool = False, progress: Callable[[int], None] = lambda _n=1: None) -> dict[str, Any]:
    """The store's own index/chunk checks plus header checks, each problem with the session it affects and whether
    it needs an operator (``HANDLED_KINDS`` say which do not)."""
    problems = _header_findings(store)
    progress(1)
    for f in store.verify(deep=deep):
        pairs = [(s, _snapshot_in(f.where)) for s in f.sessions]
        if f.sessions and not _snapshot_in(f.where) and "chunk " in f.where:  # a chunk: name each user's snapshot too
            pairs = [p for p in _affected(store, f.where) if p[0] in f.sessions] or pairs
        for session, snapshot in (pairs or _affected(store, f.where)):
            problems.append({"kind": f.kind, "where": f.where, "detail": f.detail, "session_id": session or None,
                             "snapshot_id": snapshot or None, "message": f"{f.kind}: {f.where}: {f.detail}"})
    progress(1)
    for p in problems:
        p["needs_operator"] = p["kind"] not in HANDLED_KINDS
    return {"deep": deep, "needs_operator": sum(p["needs_operator"] for p in problems),
            "handled": sum(not p["needs_operator"] for p in problems), "snapshots": sum(1 for _ in store.admin.iter_manifests(skip_damaged=True)),
            "chunks": sum(1 for _ in store.admin.iter_chunks(skip_damaged=True)), "problems": problems}


def gc(store: Store, dry_run: bool = False) -> dict[str, Any]:
    report = store.gc(dry_run=dry_run)
    return {"dry_run": report.dry_run, "objects": len(report.orphan_objects), "bytes": report.bytes,
            "orphan_objects": report.orphan_objects, "orphan_manifests": report.orphan_manifests,
            "tmp_files": report.tmp_files, "expired_leases": report.expired_leases, "skipped": report.skipped,
            "tombstones": report.tombstones,
            # deprecated keys, kept for one release (docs/API.md, "Renamed"): the same values
            "blobs": len(report.orphan_objects), "orphan_blobs": report.orphan_objects}


def repair(store: Store, dry_run: bool = False, remote: str | None = None,
           remote_prefix: str | None = None) -> dict[str, Any]:
    """``kvshelf repair``: the store's ``RepairReport`` as a document (``integrity/repair.py`` says what it does);
    ``remote``: a shared tier to take good copies of damaged chunks from."""
    r = store.repair(dry_run=dry_run, remote=remote, remote_prefix=remote_prefix or "kvshelf:")
    return {"dry_run": r.dry_run, "lost": r.lost, "dropped_quarantined": r.dropped_quarantined,
            "bad_chunks": r.bad_chunks, "healed": r.healed, "dropped_checkpoints": r.dropped_checkpoints, "rewritten_trailers": r.rewritten_trailers,
            "reclaimed_bytes": r.reclaimed_bytes, "reclaimed_objects": r.reclaimed_objects, "remaining": r.remaining}


def quarantine_ls(store: Store) -> dict[str, Any]:
    """``kvshelf quarantine ls``: every quarantined snapshot and every chunk copy marked bad."""
    return {"quarantined": store.admin.quarantined(), "bad_chunks": store.admin.bad_chunks()}


def quarantine_drop(store: Store, snapshot_id: str | None) -> dict[str, Any]:
    """``kvshelf quarantine drop ID|--all``: forget quarantine records (``gc`` may then take their evidence)."""
    ids = [q["snapshot_id"] for q in store.admin.quarantined()] if snapshot_id is None else [snapshot_id]
    return {"dropped": [sid for sid in ids if store.drop_quarantined(sid)], "asked": ids}


def remote_admin(remote: str, prefix: str | None = None):
    """The shared tier, identity-blind (``kvshelf ls/stats/gc --remote``)."""
    from ..store.admin import RemoteAdmin
    from ..store.remote import DEFAULT_PREFIX

    return RemoteAdmin(remote, prefix=prefix or DEFAULT_PREFIX)


def remote_sessions(remote: str, prefix: str | None = None) -> list[dict[str, Any]]:
    with remote_admin(remote, prefix) as tier:
        return tier.entries()


def remote_stats(remote: str, prefix: str | None = None) -> dict[str, Any]:
    with remote_admin(remote, prefix) as tier:
        return tier.stats()


def remote_forget_tenant(remote: str, tenant: str, prefix: str | None = None) -> int:
    """``kvshelf forget --tenant T --remote URL``: the tier's entries of ``tenant`` (``RemoteAdmin.forget_tenant``)."""
    from ..store import tenant_token

    with remote_admin(remote, prefix) as tier:
        return tier.forget_tenant(tenant_token(tenant))


def of_tenant(rows: list[dict[str, Any]], tenant: str | None) -> list[dict[str, Any]]:
    """The rows (``list_sessions``'s, ``entries``') whose namespace is in ``tenant``'s scope; all when None."""
    from ..store import tenant_of, tenant_token

    if tenant is None:
        return rows
    token = tenant_token(tenant)
    return [r for r in rows if "namespace" in r and tenant_of(r["namespace"]) == token]


def tenant_totals(store: Store) -> dict[str, dict[str, int]]:
    """Per tenant token (``""``: the default tenant): its sessions, checkpoints and the bytes its snapshots
    reference — what ``kvshelf stats`` shows per tenant."""
    from ..store import tenant_of

    out: dict[str, dict[str, int]] = {}
    for m in store.admin.iter_manifests():
        row = out.setdefault(tenant_of(m.namespace), {"sessions": 0, "checkpoints": 0, "bytes": 0})
        row["checkpoints" if is_checkpoint(m.session_id) else "sessions"] += 1
        row["bytes"] += m.nbytes
    return dict(sorted(out.items()))


def remote_gc(remote: str, prefix: str | None = None, dry_run: bool = False, wait: float = 10.0) -> dict[str, Any]:
    with remote_admin(remote, prefix) as tier:
        return tier.gc(dry_run=dry_run, wait=wait)


def rebuild_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Rebuild the index from the packs (offline: ``StoreBusy`` while another process has the store open)."""
    path = require_path(path, "store path")
    if not any((Path(path) / d).is_dir() for d in ("packs", "blobs")):
        raise StoreMissing(f"no kvshelf packs or v1 chunk directory at {Path(path)}")
    started = time.perf_counter()
    set_aside = None
    try:
        with open_admin(path, create=True):
            pass
    except CorruptData:  # the index itself is damaged (truncated, overwritten): rebuild next to it
        from ..store.admin import set_aside_index

        set_aside = set_aside_index(str(path))
    with open_admin(path, create=True) as store:
        try:
            count = store.rebuild_index()
        except StoreBusy as exc:
            raise StoreBusy(f"{exc}; rebuild-index is an offline repair: stop the other users first") from None
        totals = chunk_totals(store)
        skipped = [{"kind": f.kind, "where": f.where, "detail": f.detail, "sessions": list(f.sessions)}
                   for f in store.admin.rebuild_report()]
    return {"snapshots": count, **totals, "skipped": skipped, "damaged_index_kept_at": set_aside,
            "seconds": round(time.perf_counter() - started, 3)}


__all__ = ["repair", "quarantine_ls", "quarantine_drop",
           "open_admin", "list_sessions", "delete_session", "show", "stats", "verify", "gc", "rebuild_index", "find_session",
           "resolve", "format_of", "orphans", "chunk_totals", "StoreMissing"]
