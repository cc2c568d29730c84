"""verify's cross-record half, streamed: chunk refcounts, per-pack counts and the index totals recomputed from the
manifests and compared with the records — in batched short read transactions, in bounded memory, and without
inventing a finding out of a save or delete that commits while verify runs.

Why streamed: the old verify read the whole index in ONE read transaction and kept every chunk record and a set of
sessions per chunk in memory; on a large store that pins LMDB's old pages for minutes (the file grows while writers
run) and costs memory proportional to the store. Now:

* **Memory.** Refcounts are counted per *partition* of the chunk-hash space: with ``C`` chunk records the hashes
  are split into ``ceil(C / COUNT_LIMIT)`` key ranges (by their first four bytes) and each range takes one pass over
  the manifests, so the counter never holds more than about ``COUNT_LIMIT`` hashes (~100 bytes each); the chunk
  records of a range are compared as they stream by (``refs.pop``), never kept. Per-pack live counts are one small
  record per pack (O(packs) ≤ O(chunks + snapshots)). Candidates and the sessions named in chunk findings are
  bounded by the findings. Nothing holds a record per manifest or per chunk of the whole store.
* **Concurrency.** Per-record checks (a manifest against its summary, tokens, session, LRU and prefix records; a
  session pointer against its manifest) run inside their batch's transaction, a consistent snapshot; what they read
  outside the index (a pack, a chunk's object) is re-checked in a fresh transaction before it is reported. Totals
  mix batches read at different moments, so each batch's transaction id is kept: one id across the whole pass
  means nothing was committed in between and the totals are as exact as one transaction; otherwise every candidate
  is recounted in ONE fresh read transaction (time O(manifests), memory O(candidates) — the only long read
  transaction left, taken only when counts disagreed while writers ran) and only what still disagrees is reported.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from ...errors import CorruptData, EncryptionKeyError, IncompatibleFormat, KvShelfError
from ..context import StoreContext
from ..index import bad_chunks, keys
from ..prefix import records
from ..index import schema
from ..objects.protocol import ObjectMissing
from ..index.schema import ChunkMeta, Manifest, PackMeta, Summary
from ..restore.chunks import open_chunk
from ..objects.protocol import open_object
from ..objects.pack import read_trailer
from ..results import Finding
from ..index.protocol import meta_int

COUNT_LIMIT = 1 << 18  # chunk hashes counted per pass over the manifests (the refcount pass's memory bound)
VERIFY_BATCH = 256  # records per read transaction


@dataclass
class Tally:
    """What the manifest pass counts (partition 0 of the refcounts; the others are counted by ``check_counts``)."""

    parts: int
    refs: Counter = field(default_factory=Counter)  # hash (16 bytes) -> indexed manifests referencing it
    manifests_in: Counter = field(default_factory=Counter)  # pack -> indexed manifests whose summary names it
    prefix_records: int = 0  # records the sessions' current snapshots imply (records.py)
    heads: int = 0  # manifests that are their session's current snapshot
    head_records: int = 0  # entries of the heads table (one per session)
    manifests: int = 0  # every manifest record, decodable or not (the LRU holds one key per snapshot)
    txn_ids: set = field(default_factory=set)

    def count(self, m: Manifest, s: Summary, n_records: int, head: bool = False) -> None:
        self.prefix_records += n_records
        self.heads += head
        if s.pack:
            self.manifests_in[s.pack] += 1
        _count_refs(self.refs, m, 0, self.parts)


@dataclass
class _Candidates:
    chunks: dict = field(default_factory=dict)  # hash -> (record refs or None, counted)
    packs: dict = field(default_factory=dict)  # name -> (PackMeta or None, [chunks, bytes, manifests])
    totals: tuple | None = None  # (prefix entries, implied, lru entries, snapshots, total, chunk sum, heads, implied)


def partitions(index) -> int:
    with index.read() as txn:
        n = txn.count("chunks")
    return max(1, -(-n // COUNT_LIMIT))


def _part(hb: bytes, parts: int) -> int:
    return (int.from_bytes(hb[:4], "big") * parts) >> 32


def _range(p: int, parts: int) -> tuple[bytes | None, bytes | None]:
    """The key range [start, stop) of partition ``p``: the hashes whose first four bytes map to it."""
    lo, hi = -(-(p << 32) // parts), -(-((p + 1) << 32) // parts)
    return (lo.to_bytes(4, "big") + bytes(12) if p else None,
            hi.to_bytes(4, "big") + bytes(12) if hi < 1 << 32 else None)


def _count_refs(refs: Counter, m: Manifest, p: int, parts: int) -> None:
    for h in {r.hash for r in m.all_chunks}:
        hb = bytes.fromhex(h)
        if parts == 1 or _part(hb, parts) == p:
            refs[hb] += 1


def _indexed(txn, index, sid: bytes, raw: bytes) -> tuple[Manifest, Summary] | None:
    """(manifest, summary) of a record the counts include: it decodes and has a decodable summary."""
    try:
        m = schema.decode(raw, Manifest, f"manifest {sid.hex()}")
        s = schema.decode(txn.get("summaries", sid) or b"", Summary, "summary")
    except (CorruptData, IncompatibleFormat):
        return None
    return m, s


def _refcount_finding(hb: bytes, refs: int | None, n: int) -> Finding | None:
    h = hb.hex()
    if refs is None:  # no record: a finding only while some snapshot still references it
        return Finding("refcount-drift", f"chunk {h}", f"referenced by {n} snapshots but has no record") if n else None
    if n == 0:
        return Finding("refcount-drift", f"chunk {h}", f"refcount {refs} but no snapshot references it")
    if refs != n:
        return Finding("refcount-drift", f"chunk {h}", f"refcount {refs}, referenced by {n}")
    return None


def _pack_finding(name: str, pm: PackMeta | None, want: list[int]) -> Finding | None:
    if pm is None:
        return Finding("pack-drift", f"pack {name}", "referenced but has no pack record") if any(want) else None
    if (pm.live_chunks, pm.live_bytes, pm.manifests) == (0, 0, 0) and not any(want):
        return None  # emptied and unlinked; the next write transaction forgets the record
    if (pm.live_chunks, pm.live_bytes, pm.manifests) != tuple(want):
        return Finding("pack-drift", f"pack {name}", f"record says {pm.live_chunks} chunks / {pm.live_bytes} bytes / "
                                                     f"{pm.manifests} manifests, the index implies {want[0]} / "
                                                     f"{want[1]} / {want[2]}")
    return None


def _total_findings(totals: tuple) -> list[Finding]:
    n_prefix, prefix_records, n_lru, n_manifests, total, chunk_sum, n_heads, heads = totals
    out = []
    if n_prefix != prefix_records:
        out.append(Finding("prefix-drift", "prefix index", f"{n_prefix} records, manifests imply {prefix_records}"))
    if n_heads != heads:
        out.append(Finding("prefix-drift", "prefix heads", f"{n_heads} prefix heads for {heads} sessions"))
    if n_lru != n_manifests:
        out.append(Finding("lru-drift", "lru index", f"{n_lru} records for {n_manifests} snapshots"))
    if total != chunk_sum:
        out.append(Finding("total-drift", "meta", f"total_bytes {total}, chunk records sum to {chunk_sum}"))
    return out


def check_counts(ctx: StoreContext, deep: bool, tally: Tally, out: list[Finding], mark_bad: bool = True) -> None:
    """Chunk records (refcounts, objects, ``deep`` content), pack records and totals against ``tally``;
    ``mark_bad``: mark each chunk copy found missing or failing its hash (``_marked``)."""
    index, parts, c = ctx.index, tally.parts, _Candidates()
    live: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
    chunk_sum, chunk_findings = 0, []
    with index.read() as txn:
        marks = {m.hash: m for m in bad_chunks.scan(txn)}
    damaged: dict[str, str] = {}  # packs whose chunks are live but whose trailer does not read: rebuild loses them
    for p in range(parts):
        refs = tally.refs if p == 0 else Counter()
        if p:
            for txn, rows in index.batches("manifests", VERIFY_BATCH):
                tally.txn_ids.add(txn.id())
                for sid, raw in rows:
                    got = _indexed(txn, index, sid, raw)
                    if got is not None:
                        _count_refs(refs, got[0], p, parts)
        start, stop = _range(p, parts)
        for key, raw in index.scan("chunks", VERIFY_BATCH, start=start, stop=stop, ids=tally.txn_ids):
            n = refs.pop(key, 0)
            try:
                meta = schema.decode(raw, ChunkMeta, "chunk record")
            except CorruptData as exc:
                if _still_bad(index, "chunks", key, ChunkMeta):
                    out.append(Finding("bad-chunk-record", f"chunk {key.hex()}", str(exc)))
                continue
            if _refcount_finding(key, meta.refs, n) is not None:
                c.chunks[key] = (meta.refs, n)
            if meta.pack:
                live[meta.pack][0] += 1
                live[meta.pack][1] += meta.stored_bytes
            chunk_sum += meta.stored_bytes
            mark = marks.get(key.hex())
            if mark is not None and (mark.pack, mark.offset) == keys.location(key.hex(), meta)[:2]:
                chunk_findings.append(_bad_chunk_finding(mark))
                continue
            found = _object_problem(ctx, key.hex(), meta, deep)
            if found is not None:
                found = _recheck_object(ctx, key, deep)  # the chunk may have moved or gone meanwhile
            if found is not None:
                chunk_findings.append(_marked(ctx, key.hex(), *found) if mark_bad else found[0])
        for hb, n in refs.items():  # referenced, but no record in this range
            c.chunks[hb] = (None, n)
    for name, raw in index.scan("packs", VERIFY_BATCH, ids=tally.txn_ids):
        name = name.decode("utf-8", "replace")
        want = [*live.pop(name, [0, 0]), tally.manifests_in.pop(name, 0)]
        try:
            pm = schema.decode(raw, PackMeta, f"pack record {name}")
        except CorruptData as exc:
            if _still_bad(index, "packs", name.encode(), PackMeta):
                out.append(Finding("bad-pack-record", f"pack {name}", str(exc)))
            continue
        if _pack_finding(name, pm, want) is not None:
            c.packs[name] = (pm, want)
        if deep and pm.live_chunks > 0 and (damage := _trailer_damage(ctx, name)) is not None:
            damaged[name] = damage
    for name in set(live) | set(tally.manifests_in):
        c.packs[name] = (None, [*live.get(name, [0, 0]), tally.manifests_in.get(name, 0)])
    with index.read() as txn:
        tally.txn_ids.add(txn.id())
        totals = (txn.count("prefix"), tally.prefix_records, txn.count("lru"),
                  tally.manifests, meta_int(txn, b"total_bytes"), chunk_sum, txn.count("heads"),
                  tally.heads)
    c.totals = totals if _total_findings(totals) else None
    if len(tally.txn_ids) == 1:  # nothing was committed during the pass: its counts are one snapshot's
        found = [f for hb, (refs, n) in c.chunks.items() if (f := _refcount_finding(hb, refs, n)) is not None]
        found += [f for name, (pm, want) in c.packs.items() if (f := _pack_finding(name, pm, want)) is not None]
        found += _total_findings(c.totals) if c.totals else []
    else:
        found = _recount(ctx, c)
    out.extend(_with_users(ctx, found + chunk_findings))
    out.extend(_trailer_users(ctx, damaged))


def _trailer_damage(ctx, name: str) -> str | None:
    """Why the trailer of pack ``name`` does not read (None: it does, or the pack is gone — another finding)."""
    try:
        with open_object(ctx.bytes, name) as r:
            read_trailer(r, name)
    except ObjectMissing:
        return None
    except CorruptData as exc:
        text = str(exc)
        return text[len(f"pack {name}: "):] if text.startswith(f"pack {name}: ") else text
    return None


def _trailer_users(ctx, damaged: dict[str, str]) -> list[Finding]:
    """A ``damaged-trailer`` finding per pack, naming the sessions whose chunks lie in it (a rebuild from packs
    indexes a pack's chunks from its trailer, so it would lose them)."""
    if not damaged:
        return []
    in_pack: dict[str, str] = {}
    for key, raw in ctx.index.scan("chunks", VERIFY_BATCH):
        try:
            meta = schema.decode(raw, ChunkMeta, "chunk record")
        except CorruptData:
            continue
        if meta.pack in damaged:
            in_pack[key.hex()] = meta.pack
    users: defaultdict[str, set[str]] = defaultdict(set)
    for h, sessions in sessions_using(ctx, set(in_pack)).items():
        users[in_pack[h]] |= sessions
    return [Finding("damaged-trailer", f"pack {name}", detail, tuple(sorted(users[name])))
            for name, detail in damaged.items()]


def sessions_using(ctx, hashes: set[str]) -> defaultdict[str, set[str]]:
    """chunk hash -> the sessions whose indexed snapshots use it, for the given hashes (one batched pass over the
    manifests; nothing read when ``hashes`` is empty)."""
    users: defaultdict[str, set[str]] = defaultdict(set)
    if not hashes:
        return users
    for sid, raw in ctx.index.scan("manifests", VERIFY_BATCH):
        try:
            m = schema.decode(raw, Manifest, f"manifest {sid.hex()}")
        except (CorruptData, IncompatibleFormat):
            continue
        for r in m.all_chunks:
            if r.hash in hashes:
                users[r.hash].add(m.session_id)
    return users


def _still_bad(index, table: str, key: bytes, kind: type) -> bool:
    """Whether a record that failed to decode still does in a fresh transaction (not rewritten meanwhile)."""
    with index.read() as txn:
        raw = txn.get(table, key)
    if raw is None:
        return False
    try:
        schema.decode(raw, kind, "record")
    except CorruptData:
        return True
    return False


def _bad_chunk_finding(mark: bad_chunks.BadMark) -> Finding:
    return Finding("bad-chunk", f"chunk {mark.hash}", f"its copy in {mark.pack} failed its hash "
                   f"({_without(mark.reason, mark.hash)}); a save of the same content heals it, else `kvshelf repair` "
                   f"drops the sessions using it")


def _without(detail: str, h: str) -> str:
    """An error's text without the ``chunk H`` it starts with when the finding already says where (no repeats)."""
    for prefix in (f"chunk {h}: ", f"chunk {h} "):
        if detail.startswith(prefix):
            return detail[len(prefix):]
    return detail


def _object_problem(ctx, h: str, meta: ChunkMeta, deep: bool) -> Finding | None:
    name, offset, _length = keys.location(h, meta)
    size = ctx.bytes.size(name)
    if size is None:
        return Finding("missing-chunk", f"chunk {h}", f"its object {name} is missing")
    if meta.pack and offset + meta.stored_bytes > size:
        return Finding("size-drift", f"chunk {h}", f"lies past the end of {name} ({size} bytes)")
    if not meta.pack and size != meta.stored_bytes:
        return Finding("size-drift", f"chunk {h}", f"file is {meta.encoding} {size} bytes, index says "
                                                  f"{meta.stored_bytes}")
    if deep:
        try:
            with open_chunk(ctx.index, ctx.bytes, h, verify=True, keyring=ctx.keys) as reader:
                reader.read_into([None] * len(reader.tensors))
        except EncryptionKeyError:  # opened without the key: everything else was checked, this chunk's plaintext
            return Finding("not-checked", f"chunk {h}", "sealed (encryption at rest): its content and checksum "
                           "need the store's key; not checked, not marked")
        except (KvShelfError, ObjectMissing, OSError) as exc:
            return Finding("corrupt-chunk", f"chunk {h}", _without(str(exc), h))
    return None


def _recheck_object(ctx, hb: bytes, deep: bool) -> tuple[Finding, tuple] | None:
    """The object check again from a fresh read of the chunk's record: a chunk dropped (its object unlinked after
    the drop committed) or moved (repack, recompression) since the batch was read is no finding. Returns the
    finding and the location of the copy it is about."""
    with ctx.index.read() as txn:
        raw = txn.get("chunks", hb)
    try:
        meta = None if raw is None else schema.decode(raw, ChunkMeta, "chunk")
    except CorruptData:
        return None  # damaged since: the record check reports it
    found = None if meta is None else _object_problem(ctx, hb.hex(), meta, deep)
    return None if found is None else (found, keys.location(hb.hex(), meta))


def _marked(ctx, h: str, found: Finding, where: tuple) -> Finding:
    """A chunk copy found missing or failing its hash is marked bad (``index/bad_chunks.py``), as a restore that
    found it would: from now on no save dedupes onto it (the next save of the content writes a fresh copy, healing
    every snapshot using it) and a lookup does not offer a snapshot that needs it. The only write verify makes, and
    not on a read-only handle (the finding is reported either way)."""
    if found.kind not in ("corrupt-chunk", "missing-chunk") or ctx.read_only:
        return found
    try:
        marked = ctx.index.write(lambda txn: bad_chunks.mark(txn, h, where, f"verify: {found.detail}"))
    except KvShelfError:
        return found  # a full disk or a busy index: the finding stands, the next verify or restore marks it
    if not marked:
        return found
    return Finding(found.kind, found.where, f"{found.detail}; marked bad: the next save of the same content writes "
                                            f"a fresh copy, else `kvshelf repair` heals or drops it", found.sessions)


def _recount(ctx, c: _Candidates) -> list[Finding]:
    """The candidates counted again in ONE fresh read transaction (consistent by construction)."""
    index = ctx.index
    refs, manifests_in, n_manifests, prefix_records, heads = Counter(), Counter(), 0, 0, 0
    with index.read() as txn:
        for sid, raw in txn.range("manifests"):
            n_manifests += 1
            got = _indexed(txn, index, bytes(sid), raw)
            if got is None:
                continue
            m, s = got
            skey = keys.manifest_keys(m)[2]
            if c.totals and txn.get("sessions", skey) == bytes(sid):  # a current snapshot: its records
                heads += 1
                prefix_records += len(records.records_after(skey[16:32], records.lineage_id(skey),
                                                            np.asarray(m.tokens, "<i8"), 0, ctx.block))
            for h in {r.hash for r in m.all_chunks}:
                if bytes.fromhex(h) in c.chunks:
                    refs[bytes.fromhex(h)] += 1
            if s.pack in c.packs:
                manifests_in[s.pack] += 1
        found = []
        for hb in c.chunks:
            raw = txn.get("chunks", hb)
            try:
                meta = None if raw is None else schema.decode(raw, ChunkMeta, "chunk record")
            except CorruptData:
                continue  # reported as a bad record
            if (f := _refcount_finding(hb, None if meta is None else meta.refs, refs[hb])) is not None:
                found.append(f)
        live, chunk_sum = defaultdict(lambda: [0, 0]), 0
        if c.packs or c.totals:
            for _key, raw in txn.range("chunks"):
                try:
                    meta = schema.decode(raw, ChunkMeta, "chunk record")
                except CorruptData:
                    continue
                chunk_sum += meta.stored_bytes
                if meta.pack in c.packs:
                    live[meta.pack][0] += 1
                    live[meta.pack][1] += meta.stored_bytes
        for name in c.packs:
            raw = txn.get("packs", name.encode())
            try:
                pm = None if raw is None else schema.decode(raw, PackMeta, f"pack record {name}")
            except CorruptData:
                continue
            if (f := _pack_finding(name, pm, [*live[name], manifests_in[name]])) is not None:
                found.append(f)
        if c.totals:
            found += _total_findings((txn.count("prefix"), prefix_records, txn.count("lru"),
                                      n_manifests, meta_int(txn, b"total_bytes"), chunk_sum,
                                      txn.count("heads"), heads))
    return found


def _with_users(ctx, found: list[Finding]) -> list[Finding]:
    """Blob findings name every session using the chunk (one batched pass over the manifests, only for them)."""
    hashes = {f.where[len("chunk "):] for f in found
              if f.kind in ("missing-chunk", "corrupt-chunk", "bad-chunk") or f.detail.endswith("but has no record")}
    if not hashes:
        return found
    users = sessions_using(ctx, hashes)
    return [Finding(f.kind, f.where, f.detail, tuple(sorted(users.get(f.where[len("chunk "):], ()))))
            if f.where[len("chunk "):] in hashes else f for f in found]


__all__ = ["COUNT_LIMIT", "Tally", "VERIFY_BATCH", "check_counts", "partitions", "sessions_using"]
