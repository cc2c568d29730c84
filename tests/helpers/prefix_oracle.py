"""The prefix table as it should be, computed from scratch, and the table as it is (``kvshelf/store/records.py``).

The expected side is built one boundary at a time with ``boundary_hash`` (not the streaming pass the store uses) from
nothing but the sessions a test believes are current: every boundary position of each session's tokens, keyed by its
hash, valued by the 16 following tokens and the session's lineage id; one head per session naming its snapshot."""

from __future__ import annotations

from collections import Counter

from kvshelf.store.identity import namespace_key
from kvshelf.store.index.keys import session_key
from kvshelf.store.prefix.hashing import boundary_hash, continuation, positions, tokens_array
from kvshelf.store.prefix.records import lineage_id


def actual(store) -> tuple[Counter, dict[bytes, bytes]]:
    """(every (key, value) of ``prefix``, duplicates counted; ``heads`` as a dict)."""
    with store.index.read() as txn:
        recs = Counter((bytes(k), bytes(v)) for k, v in txn.dup_items("prefix"))
        heads = {bytes(k): bytes(v) for k, v in txn.range("heads")}
    return recs, heads


def expected(identity_key: bytes, sessions: dict[tuple[str, str], tuple[list[int], str]]
             ) -> tuple[Counter, dict[bytes, bytes]]:
    """``sessions``: (session id, namespace) -> (tokens, snapshot id hex) of every current session."""
    recs: Counter = Counter()
    heads: dict[bytes, bytes] = {}
    for (name, namespace), (toks, snapshot_id) in sessions.items():
        nsk = namespace_key(identity_key, namespace)
        lineage = lineage_id(session_key(identity_key, nsk, name))
        arr = tokens_array(toks)
        for p in positions(len(arr)):
            recs[(boundary_hash(nsk, arr, p), continuation(arr, p) + lineage)] += 1
        heads[lineage] = bytes.fromhex(snapshot_id)
    return recs, heads


def current(store, namespaces=None) -> dict[tuple[str, str], tuple[list[int], str]]:
    """What the store lists as current (for stores whose sessions a test did not track itself)."""
    out = {}
    for info in store.sessions(namespace=None):
        if namespaces is None or info.namespace in namespaces:
            out[(info.session_id, info.namespace)] = (list(store.admin.manifest(info.snapshot_id).tokens), info.snapshot_id)
    return out


def brute_force(sessions, prompt: list[int]) -> int:
    """API.md's rule over every current session, all of them trimmable with floor 0."""
    best = 0
    for toks, _sid in sessions.values():
        lcp = next((i for i, (a, b) in enumerate(zip(toks, prompt)) if a != b), min(len(toks), len(prompt)))
        best = max(best, min(lcp, len(prompt) - 1))
    return best


__all__ = ["actual", "brute_force", "current", "expected"]
