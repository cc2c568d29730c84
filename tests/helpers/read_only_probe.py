"""Run every read and every write of the library on a store this process cannot write; print one JSON document.

Run as a script (``python read_only_probe.py STORE OUT_DIR``) by tests/store/test_store_read_only.py, as an
unprivileged user or on a read-only mount: reads give their results (compared by the test with what the owner
sees), writes give the error class and message they raised (the test checks each names the path and the missing
permission). ``python read_only_probe.py STORE OUT_DIR EXPECTED_JSON`` probes a copy of a committed store of an
older index format (``tests/data``) the same way, its reads compared with what the fixture's JSON records.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tools_data import MODEL, make_caches, reads, tokens_for  # noqa: E402

from kvshelf import Identity, open_store  # noqa: E402
from kvshelf.tools.compaction import compact  # noqa: E402
from kvshelf.tools.transfer import export_session  # noqa: E402


def _digest(caches) -> list[str]:
    import hashlib
    return [hashlib.sha256(a.tobytes()).hexdigest() for a in reads(caches)]


def _attempt(fn) -> dict:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test judges the class and the message
        return {"raised": type(exc).__name__, "kvshelf": type(exc).__module__.startswith("kvshelf"),
                "message": str(exc)}
    return {"raised": None}


def probe(store_dir: str, out_dir: str) -> dict:
    doc: dict = {"uid": os.geteuid()}
    with open_store(store_dir, identity=MODEL, chunk_tokens=32) as store:
        doc["read_only"] = store.read_only
        doc["sessions"] = sorted(s.session_id for s in store.sessions(None))
        doc["restore"] = _digest(store.restore("s-mla").caches)
        hit = store.lookup(tokens_for(70, 1) + [7, 8, 9])
        doc["lookup"] = None if hit is None else [hit.session_id, hit.length]
        doc["restore_prefix"] = _digest(store.restore_prefix(tokens_for(70, 1) + [7]).caches)
        doc["restore_batch"] = store.restore_batch(["s-mla", "s-mla-copy"]).lengths
        doc["verify_deep"] = [f.kind for f in store.verify(deep=True)]
        doc["stats"] = sorted(store.stats())
        doc["gc_dry_run"] = store.gc(dry_run=True).dry_run
        doc["compact_dry_run"] = _plan(store)
        doc["repair_dry_run"] = store.repair(dry_run=True).remaining == []
        export_session(store_dir, "s-mla", Path(out_dir) / "s-mla.kvs")
        doc["export"] = (Path(out_dir) / "s-mla.kvs").stat().st_size > 0
        caches = make_caches("mla", 40, 5)
        doc["writes"] = {
            "save": _attempt(lambda: store.save("new", tokens_for(40, 5), caches)),
            "save_async": _attempt(lambda: store.save_async("new", tokens_for(40, 5), caches)),
            "delete": _attempt(lambda: store.delete("s-mla")),
            "pin": _attempt(lambda: store.pin("s-mla")),
            "unpin": _attempt(lambda: store.unpin("s-mla")),
            "gc": _attempt(lambda: store.gc(dry_run=False)),
            "rebuild_index": _attempt(store.rebuild_index),
            "drop_quarantined": _attempt(lambda: store.drop_quarantined("00" * 16)),
            "repack": _attempt(lambda: store.admin.repack()),
            "compact": _attempt(lambda: compact(store, cold_after=0.0)),
            "repair": _attempt(lambda: store.repair(dry_run=False)),
        }
    return doc


def _plan(store) -> dict:
    plan = compact(store, cold_after=0.0, dry_run=True)
    return {"dry_run": plan.dry_run, "steps": [s.name for s in plan.steps],
            "index": [plan.step("index").bytes_before, plan.step("index").bytes_after]}


def probe_older(store_dir: str, out_dir: str, expected_json: str) -> dict:
    """A committed store of an older index format (``tests/data``): every read, against the fixture's JSON."""
    sys.path.insert(0, os.path.dirname(expected_json))  # tests/data: the fixtures' own checksum
    from make_v1_store import state_checksum
    from prefix_oracle import actual, expected

    with open(expected_json) as f:
        want = json.load(f)
    doc: dict = {"uid": os.geteuid(), "restore": {}, "lookup": {}, "restore_prefix": {}}
    with open_store(store_dir, identity=Identity(*want["identity"]), chunk_tokens=want["chunk_tokens"]) as store:
        doc["read_only"] = store.read_only
        listed = {(s.session_id, s.namespace): s.snapshot_id for s in store.sessions(namespace=None)}
        doc["sessions"] = sorted(name for name, _ns in listed)
        for name, s in want["sessions"].items():
            ns = s.get("namespace", "")
            got = store.restore(name, namespace=ns)
            doc["restore"][name] = (got.tokens == s["tokens"]
                                    and [state_checksum(c) for c in got.caches] == s["checksums"])
            hit = store.lookup(s["tokens"] + [7], namespace=ns)
            doc["lookup"][name] = None if hit is None else [hit.session_id, hit.length]
            doc["restore_prefix"][name] = store.restore_prefix(s["tokens"] + [7], namespace=ns).length
        # the prefix records this handle reads are exactly the ones the format upgrade would write
        sessions = {(name, s.get("namespace", "")): (s["tokens"], listed[(name, s.get("namespace", ""))])
                    for name, s in want["sessions"].items()}
        doc["prefix_records_as_upgraded"] = actual(store) == expected(store.id_key, sessions)
        doc["verify_deep"] = [f"{f.kind}: {f.detail}" for f in store.verify(deep=True)]
        doc["stats"] = store.stats()["snapshots"]
        doc["gc_dry_run"] = store.gc(dry_run=True).dry_run
        doc["compact_dry_run"] = _plan(store)
        first = sorted(want["sessions"])[0]
        export_session(store_dir, first, Path(out_dir) / "older.kvs",
                       namespace=want["sessions"][first].get("namespace", ""))
        doc["export"] = (Path(out_dir) / "older.kvs").stat().st_size > 0
        doc["writes"] = {
            "save": _attempt(lambda: store.save("new", [1, 2, 3], store.restore(first).caches)),
            "delete": _attempt(lambda: store.delete(first)),
            "gc": _attempt(lambda: store.gc(dry_run=False)),
            "rebuild_index": _attempt(store.rebuild_index),
            "compact": _attempt(lambda: compact(store, cold_after=0.0)),
        }
    return doc



if __name__ == "__main__":
    print(json.dumps(probe(*sys.argv[1:3]) if len(sys.argv) == 3 else probe_older(*sys.argv[1:4])))
