"""Every key layout of the index and every object name of the byte store, in one place.

Index keys (raw bytes; ``sid`` = 16-byte snapshot id, ``idk``/``nsk`` = 16-byte identity / namespace keys):
``sessions`` idk+nsk+session utf-8 → sid; ``lru`` idk+be64(last used ns)+sid → b""; ``quarantine`` as ``sessions``;
``chunks`` 16-byte hash → ChunkMeta; ``packs`` pack name utf-8 → PackMeta; ``manifests``/``summaries``/``tokens``
sid → record; ``prefix`` boundary hash → continuation + lineage id (dupsort); ``heads`` lineage id → sid of the
session's current snapshot (``records.py`` says why records name the session, not the snapshot).

Objects: ``packs/<uuid>.pack`` (layout v2), ``blobs/<hh>/<hash>.safetensors|.kvz`` (v1 chunk files),
``blobs/manifests/<sid>.msgpack`` (v1 manifest files; ``.quarantined`` once hidden), ``tomb/<sid>`` (a dropped
snapshot whose pack outlives it: ``rebuild_index`` must not bring it back).
"""

from __future__ import annotations

import os

import hashlib
import struct

from ..identity import identity_key, namespace_key
from .schema import ChunkMeta, Manifest, Summary

LEGACY_EXT = {"raw": "safetensors", "zstd": "kvz"}
LEGACY_MANIFESTS = "blobs/manifests/"


def be64(n: int) -> bytes:
    return struct.pack(">Q", n)


def after_prefix(prefix: bytes) -> bytes | None:
    """The first key past every key that starts with ``prefix`` (a range's stop; None: no such key)."""
    head = prefix.rstrip(b"\xff")
    return head[:-1] + bytes([head[-1] + 1]) if head else None


def session_key(idk: bytes, nsk: bytes, session_id: str) -> bytes:
    return idk + nsk + session_id.encode("utf-8", "surrogatepass")


_LINEAGE = b"kvshelf-lineage1"  # BLAKE2b personalisation (16 bytes): lineage ids never equal another hash's output


def lineage_id(session_key_: bytes) -> bytes:
    """The 16 bytes that tag every prefix record of a session, stable across its saves. BLAKE2b, not xxh3: session
    ids are chosen by clients, and two lineages made to collide would share (and delete) each other's records."""
    return hashlib.blake2b(session_key_, digest_size=16, person=_LINEAGE).digest()


def session_of_key(key: bytes) -> str:
    return bytes(key[32:]).decode("utf-8", "replace")


def lru_key(idk: bytes, last_used_ns: int, sid: bytes) -> bytes:
    return idk + be64(last_used_ns) + sid


def lru_sid(key: bytes) -> bytes:
    return bytes(key[24:40])


def summary_session_key(s: Summary) -> bytes:
    return session_key(s.id_key, s.ns_key, s.session_id)


def identity_key_of(manifest: Manifest) -> bytes:
    return identity_key(manifest.model_id, manifest.config_fingerprint, manifest.tokenizer_hash)


def manifest_keys(manifest: Manifest) -> tuple[bytes, bytes, bytes]:
    """(idk, nsk, session key) of a manifest."""
    idk = identity_key_of(manifest)
    nsk = namespace_key(idk, manifest.namespace)
    return idk, nsk, session_key(idk, nsk, manifest.session_id)


def legacy_chunk_file(hash_: str, encoding: str) -> str:
    return f"blobs/{hash_[:2]}/{hash_}.{LEGACY_EXT[encoding]}"


def legacy_manifest(sid_hex: str, quarantined: bool = False) -> str:
    return f"{LEGACY_MANIFESTS}{sid_hex}.{'quarantined' if quarantined else 'msgpack'}"


def location(hash_: str, meta: ChunkMeta) -> tuple[str, int, int | None]:
    """(object, offset, length) of a chunk: inside its pack, or a whole v1 chunk file file (length: the file's)."""
    if meta.pack:
        return meta.pack, meta.offset, meta.stored_bytes
    return legacy_chunk_file(hash_, meta.encoding), 0, None


def parse_legacy_chunk_file(name: str) -> tuple[str, str] | None:
    """(hash, encoding) of a v1 chunk file object name, else None."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != "blobs" or len(parts[1]) != 2:
        return None
    stem, _, ext = parts[2].partition(".")
    encoding = {"safetensors": "raw", "kvz": "zstd"}.get(ext)
    if encoding is None or len(stem) != 32 or not stem.startswith(parts[1]):
        return None
    return stem, encoding


# A session's checkpoint (``save/checkpoints.py``) is saved under a derived session id: never a client's (session ids
# refuse NUL: ``inputs.check_session_id``), and a session's checkpoints sort after it, in k order.
CHECKPOINT_MARK = "\x00ckpt:"
_DIGITS = 12                   # zero-padded, so the ``sessions`` range lists a session's checkpoints in k order


def checkpoint_id(session_id: str, k: int) -> str:
    """The derived session id a checkpoint of ``session_id`` at ``k`` tokens is saved under."""
    return f"{session_id}{CHECKPOINT_MARK}{k:0{_DIGITS}d}"


def is_checkpoint(session_id: str) -> bool:
    return CHECKPOINT_MARK in session_id


def parent_of(session_id: str) -> tuple[str, int] | None:
    """(session id, k) of a checkpoint's derived id; None for a session's own id."""
    head, mark, k = session_id.rpartition(CHECKPOINT_MARK)
    if not mark or not k.isdigit():
        return None
    return head, int(k)


def open_lock_path(root: str) -> str:
    """``locks/open.lock``: held shared by every open handle, exclusively by an offline job (``liveness/open_lock.py``)
    and by moving a damaged index aside (``lmdb_check.set_aside``)."""
    return os.path.join(root, "locks", "open.lock")

__all__ = ["CHECKPOINT_MARK", "after_prefix", "be64", "checkpoint_id", "identity_key_of", "is_checkpoint",
           "legacy_chunk_file", "legacy_manifest", "lineage_id", "location", "lru_key", "lru_sid", "manifest_keys",
           "open_lock_path", "parent_of", "parse_legacy_chunk_file", "session_key", "session_of_key", "summary_session_key",
           ]
