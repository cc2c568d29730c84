"""``kvshelf gc --incompatible``: reclaim the snapshots no current identity can use.

Why: a served model's identity covers its weights' content, its config, tokenizer and chat template, the KV-cache
settings and the codecs' cache-format tags. After a model upgrade, a re-conversion, a ``--kv-bits`` change or a
kvshelf release that changes a cache layout, the old snapshots are another identity's: never served again, but they
hold space until the byte budget's LRU happens to reach them. This reclaims them at once.

What "current" means: the identities the operator names, never a guess. Each ``--model DIR`` is fingerprinted
exactly as ``kvshelf serve`` would fingerprint it now (this kvshelf's codec tags, the given ``--model-id``,
``--kv-bits``/``--kv-group-size``/``--quantized-kv-start`` and ``--chat-template``), and ``--keep-identity KEY``
keeps an identity by the key this command lists (for a server with other settings, or a model not on this host).
A rule like "every identity used within N days" would keep an upgraded-away identity for N days after the upgrade
and reclaim a rarely used but current model's caches; naming the models in service is what the operator knows. With
nothing named the command refuses, since every snapshot would be "incompatible".
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import KvShelfError, SnapshotNotFound
from ..store import open_store
from ..store.identity import Identity, identity_key
from ..store.index import is_checkpoint, parent_of
from . import admin


class NothingCurrent(KvShelfError, ValueError):
    """``gc --incompatible`` without any ``--model`` or ``--keep-identity``: every snapshot would go."""


def current_identities(store_dir: str | os.PathLike, models: list[str], *, model_id: str | None = None,
                       kv_bits: int | None = None, kv_group_size: int = 64, quantized_kv_start: int = 5000,
                       chat_template: str | None = None) -> dict[str, Identity]:
    """Identity key (hex) -> Identity of each model directory as ``kvshelf serve`` with these options names it."""
    from ..mlx_lm.serve.model_identity import model_identity  # needs mlx-lm; the caller reports its absence

    settings = ({"kv_bits": kv_bits, "kv_group_size": kv_group_size, "quantized_kv_start": quantized_kv_start}
                if kv_bits is not None else None)
    out = {}
    for model in models:
        ident = model_identity(model, model_id=model_id, chat_template=chat_template, cache_settings=settings,
                               fingerprints=store_dir)
        out[ident.key.hex()] = ident
    return out


def _key_hex(m) -> str:
    return identity_key(m.model_id, m.config_fingerprint, m.tokenizer_hash).hex()


def find(store, keep: set[str]) -> list[dict[str, Any]]:
    """Every identity in the store not in ``keep``, with its snapshots (id, session, namespace, tokens)."""
    by_key: dict[str, dict[str, Any]] = {}
    for m in store.admin.iter_manifests(skip_damaged=True):
        key = _key_hex(m)
        if key in keep:
            continue
        ident = by_key.setdefault(key, {"identity_key": key, "model_id": m.model_id,
                                        "config_fingerprint": m.config_fingerprint,
                                        "tokenizer_hash": m.tokenizer_hash, "snapshots": []})
        ident["snapshots"].append({"snapshot_id": m.snapshot_id, "session_id": m.session_id,
                                   "namespace": m.namespace, "tokens": m.length})
    for ident in by_key.values():
        ident["snapshots"].sort(key=lambda s: (s["namespace"], s["session_id"], s["snapshot_id"]))
    return sorted(by_key.values(), key=lambda i: (i["model_id"], i["identity_key"]))


def _sessions(ident: dict[str, Any]) -> list[tuple[str, str]]:
    """The sessions to delete: a checkpoint goes with its session (``delete`` drops a session's checkpoints)."""
    out = set()
    for s in ident["snapshots"]:
        sid = s["session_id"]
        out.add(((parent_of(sid) or (sid, 0))[0] if is_checkpoint(sid) else sid, s["namespace"]))
    return sorted(out)


def gc_incompatible(store_dir: str | os.PathLike, keep: dict[str, Identity | None], *,
                    dry_run: bool = False) -> dict[str, Any]:
    """List (``dry_run``) or delete every snapshot of an identity not in ``keep``, then reclaim their chunks."""
    if not keep:
        raise NothingCurrent(f"{store_dir}: gc --incompatible needs the identities in service (--model DIR, "
                             f"--keep-identity KEY); without any, every snapshot would be removed")
    with admin.open_admin(store_dir) as store:
        found = find(store, set(keep))
        before = admin.chunk_totals(store)
    doc: dict[str, Any] = {"dry_run": dry_run, "kept": sorted(keep), "incompatible": found,
                           "snapshots": sum(len(i["snapshots"]) for i in found), "sessions_deleted": 0,
                           "chunks_freed": 0, "bytes_freed": 0, "objects": 0, "bytes": 0}
    if dry_run or not found:
        return doc
    for ident in found:
        identity = Identity(ident["model_id"], ident["config_fingerprint"], ident["tokenizer_hash"])
        with open_store(str(store_dir), identity=identity) as scoped:
            for session_id, namespace in _sessions(ident):
                try:
                    scoped.delete(session_id, namespace)
                    doc["sessions_deleted"] += 1
                except SnapshotNotFound:  # only checkpoints of a session already gone: gc takes their chunks
                    pass
    with admin.open_admin(store_dir) as store:  # deleting freed the chunks only they used; gc takes any residue
        reclaimed = admin.gc(store, dry_run=False)
        doc["remaining"] = sum(len(i["snapshots"]) for i in find(store, set(keep)))
        after = admin.chunk_totals(store)
    doc["chunks_freed"] = before["chunks"] - after["chunks"]
    doc["bytes_freed"] = before["stored_bytes"] - after["stored_bytes"]
    doc["objects"], doc["bytes"] = reclaimed["objects"], reclaimed["bytes"]
    return doc


__all__ = ["NothingCurrent", "current_identities", "find", "gc_incompatible"]
