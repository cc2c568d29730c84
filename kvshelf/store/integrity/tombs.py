"""Which tombstones gc may remove: those no surviving manifest on disk still needs.

Why tombstones exist: ``rebuild_index`` rebuilds the index from the manifests it finds on disk (pack trailers, v1
manifest files). A dropped snapshot's pack outlives it while other snapshots still reference chunks in it, and a
session's older snapshots (replaced by later saves, never tombstoned themselves) may survive the same way. The
tombstone ``tomb/<sid>`` — ``[session key, created_at, reason]`` — keeps a rebuild from bringing back that snapshot
or any snapshot of its session created at or before it (``rebuild._tombs``).

So a tombstone is needed exactly while some manifest-bearing object that the index does not hold (a *dead
manifest*) belongs to its snapshot or to its session. Manifest-bearing objects are named after their snapshot
(``packs/<sid>.pack``, ``packs/<sid>-<x>.pack`` for a rewrite, ``blobs/manifests/<sid>.msgpack``), so finding the dead
ones is a listing plus one index get per object; only dead ones have their manifest read (to learn their session).
The rule is conservative: all tombstones of a session stay while any dead manifest of it remains, an unreadable dead
manifest keeps every tombstone, a tombstone whose content is unreadable stays until its own snapshot's objects are
gone, and quarantine tombstones (``.quarantined``: evidence) are never removed here.

Concurrency: tombstones are listed before the objects, and an object never comes back once deleted, so a
tombstone written meanwhile is simply not considered, and one listed is removed only if, after it was written, no
object needing it was seen.
"""

from __future__ import annotations

import msgspec

from ...errors import CorruptData, IncompatibleFormat, KvShelfError
from ..index import keys
from ..index import schema
from ..objects.protocol import ObjectMissing
from ..objects.protocol import open_object
from ..index.schema import Manifest
from ..objects.pack import PACK_DIR, TOMB_DIR, is_pack, read_trailer

_HEX = set("0123456789abcdef")


def _sid_of(name: str) -> str | None:
    """The snapshot id a manifest-bearing object is named after, else None."""
    if is_pack(name):
        stem = name[len(PACK_DIR):-len(".pack")]
    elif name.startswith(keys.LEGACY_MANIFESTS):
        stem = name[len(keys.LEGACY_MANIFESTS):].split(".")[0]
    else:
        return None
    sid = stem[:32]
    return sid if len(sid) == 32 and set(sid) <= _HEX and (len(stem) == 32 or stem[32] == "-") else None


def _read(byte_store, name: str) -> bytes:
    buf = bytearray(byte_store.size(name) or 0)
    byte_store.read_into(name, 0, [memoryview(buf)])
    return bytes(buf)


_NO_MANIFEST = b""


def _dead_manifest_session(byte_store, name: str) -> bytes | None:
    """The session key of the manifest in ``name``; ``_NO_MANIFEST`` for a pack that carries none (written by a
    tool: its uuid name looks like a snapshot id); None when it cannot be read."""
    try:
        if is_pack(name):
            with open_object(byte_store, name) as reader:
                raw = read_trailer(reader, name).manifest
            if not raw:
                return _NO_MANIFEST
        else:
            raw = _read(byte_store, name)
        return keys.manifest_keys(schema.decode(raw, Manifest, f"manifest in {name}"))[2]
    except (CorruptData, IncompatibleFormat, ObjectMissing, KvShelfError, OSError):
        return None


def removable_tombs(index, byte_store) -> list[str]:
    """Plain tombstones (``tomb/<sid>``) that no dead manifest on disk needs any more."""
    tombs: dict[str, tuple[str, bytes | None]] = {}  # name -> (sid, session key or None when unreadable)
    for name in byte_store.names(TOMB_DIR):
        rest = name[len(TOMB_DIR):]
        if "." in rest or len(rest) != 32:
            continue  # quarantine evidence (or not ours): kept
        try:
            skey, _created, _reason = msgspec.msgpack.decode(_read(byte_store, name))
            tombs[name] = (rest, bytes(skey))
        except (ValueError, TypeError, msgspec.DecodeError, KvShelfError, OSError):
            tombs[name] = (rest, None)
    if not tombs:
        return []
    bearing: dict[str, list[str]] = {}
    for prefix in (PACK_DIR, keys.LEGACY_MANIFESTS):
        for name in byte_store.names(prefix):
            sid = _sid_of(name)
            if sid is not None:
                bearing.setdefault(sid, []).append(name)
    with index.read() as txn:
        dead = {sid: names for sid, names in bearing.items()
                if txn.get("manifests", bytes.fromhex(sid)) is None}
    needed_sessions: set[bytes] = set()
    for sid, names in dead.items():
        for name in names:
            skey = _dead_manifest_session(byte_store, name)
            if skey is None:
                if byte_store.exists(name):
                    return []  # an unreadable dead manifest: whose it is cannot be known, keep every tombstone
                continue
            if skey != _NO_MANIFEST:
                needed_sessions.add(skey)
    return sorted(name for name, (sid, skey) in tombs.items()
                  if not any(byte_store.exists(n) for n in dead.get(sid, ()))  # its own manifest is gone
                  and skey is not None and skey not in needed_sessions)


__all__ = ["removable_tombs"]
