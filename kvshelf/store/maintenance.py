"""Checking and repairing a store: ``verify`` (the test oracle), ``gc`` (crash residue) and ``rebuild_index``.

``verify`` recomputes from the manifests what every other table must hold (refcounts, prefix records, sessions, LRU
keys, total bytes) and compares, then checks the blob directory against the index. ``gc`` only removes what no index
record references, holding the save gate exclusively (no save is between writing blobs and committing) and LMDB's
writer lock while unlinking. ``rebuild_index`` re-indexes every manifest file whose blobs are all present.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CorruptData, IncompatibleFormat
from . import manifest as mf
from .blobs import pid_alive
from .manifest import ChunkMeta, Lease, Manifest, Summary
from .prefix import all_boundaries
from .results import Finding, GcReport

if TYPE_CHECKING:
    from .store import Store


def verify_store(store: "Store", deep: bool = False) -> list[Finding]:
    from .store import identity_key_of
    from .identity import namespace_key

    db = store.index.db
    out: list[Finding] = []
    refs: Counter[str] = Counter()
    prefix_records = 0
    with store.index.read() as txn:
        manifests = {}
        for sid, raw in txn.cursor(db=db["manifests"]):
            try:
                manifests[sid] = mf.decode(raw, Manifest, f"manifest {sid.hex()}")
            except (CorruptData, IncompatibleFormat) as exc:
                out.append(Finding("bad-manifest", sid.hex(), str(exc)))
        prefix_cur = txn.cursor(db=db["prefix"])
        for sid, m in manifests.items():
            where = f"snapshot {sid.hex()} (session {m.session_id!r})"
            idk = identity_key_of(m)
            nsk = namespace_key(idk, m.namespace)
            raw = txn.get(sid, db=db["summaries"])
            if raw is None:
                out.append(Finding("missing-summary", where, "no summary record"))
                continue
            s = mf.decode(raw, Summary, "summary")
            if (s.id_key, s.ns_key, s.session_id, s.length, s.nbytes) != (idk, nsk, m.session_id, m.length, m.nbytes):
                out.append(Finding("summary-drift", where, "summary disagrees with the manifest"))
            toks = txn.get(sid, db=db["tokens"])
            if toks is None or not np.array_equal(np.frombuffer(toks, "<i8"), np.asarray(m.tokens, "<i8")):
                out.append(Finding("tokens-drift", where, "stored tokens differ from the manifest"))
            skey = idk + nsk + m.session_id.encode("utf-8", "surrogatepass")
            if txn.get(skey, db=db["sessions"]) != sid:
                out.append(Finding("stale-snapshot", where, "its session points elsewhere"))
            if txn.get(idk + s.last_used_ns.to_bytes(8, "big") + sid, db=db["lru"]) is None:
                out.append(Finding("lru-drift", where, "no LRU record"))
            bounds = all_boundaries(nsk, np.asarray(m.tokens, "<i8"), store.block)
            prefix_records += len(bounds)
            missing = sum(1 for key, cont in bounds if not prefix_cur.set_key_dup(key, cont + sid))
            if missing:
                out.append(Finding("prefix-drift", where, f"{missing} of {len(bounds)} prefix records missing"))
            if store.blobs.get_manifest(m.snapshot_id) is None:
                out.append(Finding("missing-manifest-file", where, "no manifest file next to the blobs"))
            elif deep and mf.decode(store.blobs.get_manifest(m.snapshot_id), Manifest, "manifest file") != m:
                out.append(Finding("manifest-file-drift", where, "manifest file differs from the index"))
            for h in {r.hash for r in m.blobs}:
                refs[h] += 1
        n_prefix = txn.stat(db["prefix"])["entries"]
        if n_prefix != prefix_records:
            out.append(Finding("prefix-drift", "prefix index", f"{n_prefix} records, manifests imply {prefix_records}"))
        n_lru = txn.stat(db["lru"])["entries"]
        if n_lru != len(manifests):
            out.append(Finding("lru-drift", "lru index", f"{n_lru} records for {len(manifests)} snapshots"))
        for key, sid in txn.cursor(db=db["sessions"]):
            if sid not in manifests:
                out.append(Finding("dangling-session", key[32:].decode("utf-8", "replace"), f"-> {sid.hex()}"))
        chunks = {}
        for key, raw in txn.cursor(db=db["chunks"]):
            chunks[bytes(key).hex()] = mf.decode(raw, ChunkMeta, "chunk record")
        total = store.index.meta_int(txn, b"total_bytes")
        leased = store._live_leases(txn)[1]
    for h, n in refs.items():
        meta = chunks.get(h)
        if meta is None:
            out.append(Finding("refcount-drift", f"blob {h}", f"referenced by {n} snapshots but has no record"))
        elif meta.refs != n:
            out.append(Finding("refcount-drift", f"blob {h}", f"refcount {meta.refs}, referenced by {n}"))
    for h, meta in chunks.items():
        if h not in refs:
            out.append(Finding("refcount-drift", f"blob {h}", f"refcount {meta.refs} but no snapshot references it"))
        st = store.blobs.stat(h)
        if st is None:
            out.append(Finding("missing-blob", f"blob {h}", "indexed blob file is missing"))
            continue
        if (st.stored_bytes, st.encoding) != (meta.stored_bytes, meta.encoding):
            out.append(Finding("size-drift", f"blob {h}", f"file is {st.encoding} {st.stored_bytes} bytes, "
                                                          f"index says {meta.encoding} {meta.stored_bytes}"))
        if deep:
            try:
                with store.blobs.open(h, verify=True) as reader:
                    reader.read_into([None] * len(reader.tensors))
            except CorruptData as exc:
                out.append(Finding("corrupt-blob", f"blob {h}", str(exc)))
    if total != sum(m.stored_bytes for m in chunks.values()):
        out.append(Finding("total-drift", "meta", f"total_bytes {total}, blob records sum to "
                                                  f"{sum(m.stored_bytes for m in chunks.values())}"))
    for st in store.blobs.iter():
        if st.hash not in chunks and st.hash not in leased:
            out.append(Finding("orphan-blob", f"blob {st.hash}", "no index record (crash residue: run gc)"))
    indexed = {sid.hex() for sid in manifests}
    for sid_hex in store.blobs.iter_manifests():
        if sid_hex not in indexed:
            out.append(Finding("orphan-manifest", f"manifest {sid_hex}", "not indexed (crash residue: run gc)"))
    return out


def gc_store(store: "Store", dry_run: bool = True) -> GcReport:
    tmp = store.blobs.reap_tmp(dry_run=dry_run)
    db = store.index.db
    now = time.time()

    def sweep_leases(txn):
        dead = []
        for key, raw in txn.cursor(db=db["leases"]):
            lease = mf.decode(raw, Lease, "lease")
            if lease.expires <= now or not pid_alive(lease.pid):
                dead.append(bytes(key))
        if not dry_run:
            for key in dead:
                txn.delete(key, db=db["leases"])
        return len(dead)

    expired = store._txn(sweep_leases) if not dry_run else _in_read(store, sweep_leases)
    try:
        gate = store.save_gate(exclusive=True, timeout=10.0)
        gate.__enter__()
    except TimeoutError:
        return GcReport(dry_run, [], [], tmp, expired, 0, "saves kept the store busy; orphan sweep skipped")
    try:
        def sweep(txn):
            leased = store._live_leases(txn)[1]
            blobs, nbytes = [], 0
            for st in list(store.blobs.iter()):
                if st.hash in leased or txn.get(bytes.fromhex(st.hash), db=db["chunks"]) is not None:
                    continue
                blobs.append(st.hash)
                nbytes += st.stored_bytes
                if not dry_run:
                    store.blobs.delete(st.hash)
            manifests = []
            for sid_hex in list(store.blobs.iter_manifests()):
                if txn.get(bytes.fromhex(sid_hex), db=db["manifests"]) is None:
                    manifests.append(sid_hex)
                    if not dry_run:
                        store.blobs.delete_manifest(sid_hex)
            return blobs, manifests, nbytes

        blobs, manifests, nbytes = store._txn(sweep) if not dry_run else _in_read(store, sweep)
    finally:
        gate.__exit__(None, None, None)
    return GcReport(dry_run, blobs, manifests, tmp, expired, nbytes)


def _in_read(store: "Store", fn):
    with store.index.read() as txn:
        return fn(txn)


def rebuild_store_index(store: "Store") -> int:
    """Replace the index by one built from the manifest files (offline: the store held ``exclusive``, so no other
    process or handle has it open; ``StoreBusy`` otherwise)."""
    with store.exclusive():
        store.replace_index(lambda path: shutil.rmtree(path, ignore_errors=True))
        return _reindex(store)


def _reindex(store: "Store") -> int:
    found = []
    for sid_hex in store.blobs.iter_manifests():
        raw = store.blobs.get_manifest(sid_hex)
        try:
            m = mf.decode(raw or b"", Manifest, f"manifest file {sid_hex}")
        except (CorruptData, IncompatibleFormat):
            continue
        if m.snapshot_id != sid_hex or any(store.blobs.stat(r.hash) is None for r in m.blobs):
            continue
        found.append(m)
    found.sort(key=lambda m: m.created_at)
    for m in found:  # oldest first: a session's newest snapshot replaces older ones, as when they were saved
        store.index.write(lambda txn, m=m: store._commit(txn, m, replaces=None))
    return len(found)


__all__ = ["verify_store", "gc_store", "rebuild_store_index"]
