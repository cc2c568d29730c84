"""The shared tier seen whole (identity-blind, for ``kvshelf ls/stats/gc --remote``): list, count, collect.

``gc`` removes chunks no index entry references, and index entries that can never be served (a summary, token or
manifest record missing or failing its checksum, a chunk evicted), safely against publishers running meanwhile:

1. it sets the ``gc`` marker (``SET NX`` with a TTL; another gc running → skipped);
2. it waits (up to ``wait`` seconds) until no publish-in-progress marker exists, else it gives up (skipped);
   a publisher sets its own marker *before* it checks for the gc marker, and gc sets its marker *before* it
   checks for publishers, so of two that start together at least one sees the other: a publisher never skips a
   chunk as "present" that this gc then deletes, and gc never deletes a chunk uploaded for an entry not yet
   committed;
3. it reads every summary (the chunk hashes each entry references), drops broken entries, deletes the rest;
4. it deletes its marker.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ...errors import CorruptData
from ..identity import tenant_of
from .client import DEFAULT_PREFIX, check_prefix, connect, redact
from . import fetch
from .errors import translate
from .search import boundary_members
from .keys import Keys
from .records import decode_summary, decode_tokens

GC_MARKER_MS = 600_000
_BATCH = 500


def _text(key) -> str:
    return key.decode() if isinstance(key, bytes) else key


class RemoteAdmin:
    def __init__(self, remote, *, prefix: str = DEFAULT_PREFIX, client=None, **options: Any):
        """``client``: a connection to reuse (a bound ``RemoteTier``'s) instead of connecting to ``remote``."""
        self.where = redact(remote) if remote is not None else "the bound shared tier"
        self.client = connect(remote, **options) if client is None else client
        self.keys = Keys(check_prefix(prefix))

    def close(self) -> None:
        self.client.close()

    def good_copy(self, hash_: str):
        """The tier's verified copy of one chunk for ``kvshelf repair --remote`` (``fetch.good_copy``), or None."""
        with translate("repair"):
            return fetch.good_copy(self.client, self.keys, hash_)

    def __enter__(self) -> RemoteAdmin:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def forget_tenant(self, token: str) -> int:
        """Drop every index entry whose namespace is in tenant ``token``'s scope (``identity.tenant_token``; every
        identity), their boundary records and session pointers; how many. The chunks they used become garbage for
        ``gc``. An entry whose summary no longer decodes names no tenant: ``gc`` drops it (it cannot be served)."""
        with translate("forget a tenant"):
            found = [(nsk, sid, s) for nsk, sid, s in self._summaries()
                     if not isinstance(s, CorruptData) and tenant_of(s.namespace) == token]
            for nsk, sid, s in found:
                self._drop(nsk, sid, s.session_id)
        return len(found)

    def _scan(self, pattern: str) -> list[str]:
        return [_text(k) for k in self.client.scan_iter(match=pattern, count=1000)]

    def _get_many(self, keys: list[str]) -> list:
        out = []
        for at in range(0, len(keys), _BATCH):
            pipe = self.client.pipeline(transaction=False)
            for k in keys[at:at + _BATCH]:
                pipe.get(k)
            out.extend(pipe.execute())
        return out

    def _summaries(self) -> list[tuple[bytes, bytes, Any]]:
        """(nsk, sid, RemoteSummary or the CorruptData it raised) of every index entry."""
        keys = self._scan(self.keys.summary_pattern)
        out = []
        for key, value in zip(keys, self._get_many(keys)):
            nsk, sid = self.keys.parse_summary_key(key)
            try:
                out.append((nsk, sid, decode_summary(value, f"summary {sid.hex()}")))
            except CorruptData as exc:
                out.append((nsk, sid, exc))
        return out

    def entries(self) -> list[dict[str, Any]]:
        """Every index entry (all identities and namespaces); broken ones flagged, not hidden."""
        with translate("list the index"):
            found = self._summaries()
        rows = []
        for nsk, sid, s in found:
            if isinstance(s, CorruptData):
                rows.append({"snapshot_id": sid.hex(), "scope": nsk.hex(), "broken": str(s)})
                continue
            rows.append({"snapshot_id": sid.hex(), "scope": nsk.hex(), "session_id": s.session_id,
                         "namespace": s.namespace, "model_id": s.model_id, "tokens": s.length,
                         "bytes": s.nbytes, "chunks": len(s.chunks), "created_at": s.created_at,
                         "minimum_reusable_offset": s.minimum_reusable_offset, "trimmable": s.trimmable,
                         "host": s.host})
        rows.sort(key=lambda r: -r.get("created_at", 0))
        return rows

    def stats(self) -> dict[str, Any]:
        with translate("stats"):
            chunks = self._scan(self.keys.chunk_pattern)
            sizes = []
            for at in range(0, len(chunks), _BATCH):
                pipe = self.client.pipeline(transaction=False)
                for k in chunks[at:at + _BATCH]:
                    pipe.strlen(k)
                sizes.extend(pipe.execute())
            found = self._summaries()
            entries = self.entries()
            publishing = len(self._scan(self.keys.publishing_pattern))
            gc_running = bool(self.client.exists(self.keys.gc))
            info = self._info()
        referenced = {h for _, _, e in found if not isinstance(e, CorruptData) for h in e.chunks}
        return {"remote": self.where, "prefix": self.keys.prefix, "entries": len(entries),
                "broken_entries": sum("broken" in e for e in entries),
                "sessions": len({(e.get("scope"), e.get("session_id")) for e in entries if "broken" not in e}),
                "tokens": sum(e.get("tokens", 0) for e in entries), "chunks": len(chunks),
                "chunk_bytes": int(sum(sizes)), "referenced_bytes": sum(e.get("bytes", 0) for e in entries),
                "unreferenced_chunks": len({c.rsplit("/", 1)[1] for c in chunks} - referenced),
                "publishing": publishing, "gc_running": gc_running, **info}

    def _info(self) -> dict[str, Any]:
        from redis.cluster import RedisCluster

        if isinstance(self.client, RedisCluster):  # one INFO per master
            nodes = list(self.client.info(target_nodes=RedisCluster.PRIMARIES).values())
        else:
            nodes = [self.client.info()]
        first = nodes[0] if nodes else {}
        return {"server": f"{'valkey' if 'valkey_version' in first else 'redis'} "
                          f"{first.get('valkey_version', first.get('redis_version', '?'))}",
                "nodes": len(nodes), "used_memory": sum(int(n.get("used_memory", 0)) for n in nodes),
                "maxmemory": sum(int(n.get("maxmemory", 0)) for n in nodes),
                "maxmemory_policy": first.get("maxmemory_policy", "?"),
                "evicted_keys": sum(int(n.get("evicted_keys", 0)) for n in nodes)}

    # ------------------------------------------------------------------ gc
    def gc(self, dry_run: bool = False, wait: float = 10.0) -> dict[str, Any]:
        token = uuid.uuid4().hex
        report: dict[str, Any] = {"dry_run": dry_run, "chunks": 0, "bytes": 0, "entries_dropped": 0,
                                  "boundary_records": 0, "skipped": ""}
        with translate("gc"):
            if not self.client.set(self.keys.gc, token, nx=True, px=GC_MARKER_MS):
                report["skipped"] = "another gc is running"
                return report
            try:
                deadline = time.monotonic() + wait
                while self._scan(self.keys.publishing_pattern):
                    if time.monotonic() > deadline:
                        report["skipped"] = "a publish is in progress"
                        return report
                    time.sleep(0.05)
                self._collect(report, dry_run)
            finally:
                if _text(self.client.get(self.keys.gc) or b"") == token:
                    self.client.delete(self.keys.gc)
        return report

    def _collect(self, report: dict[str, Any], dry_run: bool) -> None:
        found = self._summaries()
        chunks = {c.rsplit("/", 1)[1]: c for c in self._scan(self.keys.chunk_pattern)}
        referenced: set[str] = set()
        live: set[bytes] = set()
        pipe = self.client.pipeline(transaction=False)
        for nsk, sid, _ in found:
            pipe.exists(self.keys.tokens(nsk, sid), self.keys.manifest(nsk, sid))
        whole = pipe.execute() if found else []
        for (nsk, sid, s), n_records in zip(found, whole):
            if isinstance(s, CorruptData):
                s = None
            servable = s is not None and n_records == 2 and all(h in chunks for h in s.chunks)
            if servable:
                referenced.update(s.chunks)
                live.add(sid)
                continue
            report["entries_dropped"] += 1
            if not dry_run:
                self._drop(nsk, sid, s.session_id if s is not None else None)
        # boundary records of entries that are gone (dropped without their tokens, or flushed in part)
        for bkey in self._scan(f"{self.keys.prefix}{{*}}:b:*"):
            stale = [m for m in self.client.zrange(bkey, 0, -1) if bytes(m[-16:]) not in live]
            report["boundary_records"] += len(stale)
            if stale and not dry_run:
                self.client.zrem(bkey, *stale)
        dead = [c for h, c in chunks.items() if h not in referenced]
        for at in range(0, len(dead), _BATCH):
            pipe = self.client.pipeline(transaction=False)
            for k in dead[at:at + _BATCH]:
                pipe.strlen(k)
            report["bytes"] += int(sum(pipe.execute()))
        report["chunks"] = len(dead)
        if not dry_run:
            for k in dead:
                self.client.delete(k)

    def _drop(self, nsk: bytes, sid: bytes, session_id: str | None) -> None:
        try:
            tokens = decode_tokens(self.client.get(self.keys.tokens(nsk, sid)), "tokens")
        except CorruptData:
            tokens = None
        pipe = self.client.pipeline(transaction=True)
        if tokens is not None:
            for key, member in boundary_members(nsk, tokens, sid, self.keys):
                pipe.zrem(key, member)
        pipe.delete(self.keys.summary(nsk, sid), self.keys.tokens(nsk, sid), self.keys.manifest(nsk, sid))
        pipe.execute()
        if session_id is not None and _text(self.client.hget(self.keys.sessions(nsk), session_id) or b"") == sid.hex():
            self.client.hdel(self.keys.sessions(nsk), session_id)


__all__ = ["RemoteAdmin", "GC_MARKER_MS"]
