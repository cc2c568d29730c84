"""The soak's damage trials: single-byte flips, truncations, swaps and deletions over a copy of a small store (and
flips over portable files), each checked by a ``Checker`` subprocess against the truth (see ``run.py``).

Files are grouped by name only (``*.mdb``: the LMDB index; a path containing ``manifest``: manifest files — on layout
v2, where manifests live in pack trailers, a "manifest" flip lands in a pack's trailer; the rest:
blobs, chunk packs), so the trials run on any store layout.
"""

from __future__ import annotations

import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GROUP_LABEL = {"blob": "blob files", "manifest": "manifest files", "lmdb": "LMDB data.mdb"}
SKIP = ("lock.mdb", "data.mdb.walked")  # LMDB's lock table; the page walk's memo (damage to it only means a walk)


def build_bases(workdir: Path) -> list[tuple[Path, list, dict]]:
    """Two small stores holding every cache kind (a grown session sharing chunks, a second namespace), plus one
    portable file per kind: (store, sessions, {file: truth})."""
    from kvshelf import open_store
    from kvshelf.codecs import save_snapshot

    from .cases import CHUNK, IDENTITY, at_rest, KINDS, make_caches, tokens_for

    bases = []
    for b, kinds in enumerate((KINDS[:5], KINDS[5:])):
        root, sessions, files = workdir / f"base{b}", [], {}
        with open_store(root, identity=IDENTITY, chunk_tokens=CHUNK, **at_rest()) as store:
            for i, kind in enumerate(kinds):
                n, seed, ns = 40 + 7 * i, 100 * b + i, "t" if i == 1 else ""
                store.save(f"s{i}", tokens_for(kind, seed, n), make_caches(kind, n, seed), namespace=ns)
                sessions.append([ns, f"s{i}", [[kind, seed, n]], True])
                path = workdir / f"portable-{kind}.safetensors"
                save_snapshot(path, tokens_for(kind, seed, n), make_caches(kind, n, seed))
                files[str(path)] = [kind, seed, n]
            kind = kinds[0]
            store.save("grown", tokens_for(kind, 100 * b, 70), make_caches(kind, 70, 100 * b))  # shares s0's chunks
            sessions.append(["", "grown", [[kind, 100 * b, 70]], True])
        bases.append((root, sessions, files))
    return bases


def store_files(root: Path) -> dict[str, list[Path]]:
    """The store's files by what they hold (judged by name only, so any layout works); locks, tmp and the page walk's
    memo excluded (``test_lmdb_pages`` covers a damaged memo)."""
    out: dict[str, list[Path]] = {"lmdb": [], "manifest": [], "blob": []}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if not path.is_file() or path.name in SKIP or rel.startswith(("locks", "tmp")) or path.stat().st_size == 0:
            continue
        kind = "lmdb" if path.name.endswith(".mdb") else "manifest" if "manifest" in rel else "blob"
        out[kind].append(path)
    return out


def _pick_byte(data: bytes, rng: random.Random) -> int:
    if rng.random() < 0.75:  # mostly bytes that hold something (an LMDB file is mostly free pages)
        import numpy as np

        nonzero = np.flatnonzero(np.frombuffer(data, dtype=np.uint8))
        if nonzero.size:
            return int(nonzero[rng.randrange(nonzero.size)])
    return rng.randrange(len(data))


def _header_end(data: bytes) -> int:
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    return 8 + n if 0 < n < len(data) and data[8:9] == b"{" else min(64, len(data))


def _trailer_range(data: bytes) -> tuple[int, int] | None:
    """Where a v2 pack keeps its manifest: the trailer (msgpack body + ``u64 len | u64 xxh3 | magic``) at the end."""
    if len(data) < 24 or data[-8:] != b"KVSHPKT\n":
        return None
    n = int.from_bytes(data[-24:-16], "little")
    return (len(data) - 24 - n, len(data)) if n < len(data) - 24 else None


def _pack_row(data: bytes, at: int) -> str | None:
    """The row of a flip at ``at`` in a v2 pack (None: not a pack): its trailer, its magic, a chunk frame's header
    (``u64 len | safetensors JSON``) or a chunk's tensor bytes."""
    span = _trailer_range(data)
    if span is None:
        return None
    if at >= span[0]:
        return "flip: pack trailers (manifest)"
    import msgspec

    try:
        _manifest, _written, table = msgspec.msgpack.decode(data[span[0]:span[1] - 24])
    except (msgspec.DecodeError, ValueError):
        return None
    for _h, off, n, _enc in table:
        if off <= at < off + n:
            return "flip: blob headers" if at < off + _header_end(data[off:off + n]) else "flip: chunk bytes"
    return "flip: pack magic"


def damage_trial(base, kind: str, rng: random.Random, workdir: Path, checker, tally, t: int) -> None:
    root, sessions, files = base
    if kind == "portable":
        src = rng.choice(sorted(files))
        data = bytearray(Path(src).read_bytes())
        data[_pick_byte(bytes(data), rng)] ^= 1 << rng.randrange(8)
        path = workdir / f"trial-{t}.safetensors"
        path.write_bytes(bytes(data))
        verdict = checker.run({"op": "portable", "path": str(path), "truth": files[src], "what": "portable"})
        path.unlink()
        tally.add("flip: portable files", verdict["status"], verdict["notes"])
        return
    trial = workdir / f"trial-{t}"
    shutil.copytree(root, trial)
    groups = store_files(trial)
    rebuild, row = False, ""
    if kind == "flip":
        group = rng.choices(["blob", "manifest", "lmdb"], weights=[45, 20, 35])[0]
        in_trailer = group == "manifest" and not groups["manifest"]  # layout v2: manifests live in pack trailers
        path = rng.choice(groups["blob"] if in_trailer else groups[group])
        data = bytearray(path.read_bytes())
        orig = bytes(data)  # rows are judged on the bytes before the flip
        at = _pick_byte(bytes(data), rng)
        span = _trailer_range(bytes(data)) if in_trailer else None
        if in_trailer:
            if span is None:
                group = "blob"
            else:
                at = rng.randrange(*span)
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        if group == "blob" and path.relative_to(trial).parts[0] == "keys":  # an encrypted store's key records
            row = "flip: key files"
        elif group == "blob":
            row = _pack_row(orig, at) or (
                "flip: tombstones" if "tomb" in str(path.relative_to(trial)) else
                "flip: blob headers" if at < _header_end(orig) else "flip: chunk bytes")
        elif group == "manifest":
            rebuild = rng.random() < 0.5
            row = "flip: manifest files + rebuild_index" if rebuild else "flip: manifest files"
        else:
            row = f"flip: {GROUP_LABEL['lmdb']}"
    else:
        group = rng.choices(["blob", "manifest", "lmdb"], weights=[50, 25, 25])[0]
        if not groups[group]:
            group = "blob"  # layout v2 has no manifest files
        path = rng.choice(groups[group])
        if kind == "truncate":
            size = path.stat().st_size
            os.truncate(path, rng.randrange(size))
        elif kind == "swap":
            same = [p for p in groups[group] if p != path] or [p for p in groups["blob"] if p != path]
            other = rng.choice(same)  # data.mdb has no twin: it is swapped with a blob
            a, b = path.read_bytes(), other.read_bytes()
            path.write_bytes(b)
            other.write_bytes(a)
        else:
            path.unlink()
        row = f"{kind}: {GROUP_LABEL[group]}"
    verdict = checker.run({"op": "store", "root": str(trial), "sessions": sessions, "damaged": True,
                           "rebuild": rebuild, "deep": True, "prefix": t % 3 == 0,
                           "what": f"{row} {path.relative_to(trial)}"})
    tally.add(row, verdict["status"], [f"{path.relative_to(trial)}: {n}" for n in verdict["notes"]])
    shutil.rmtree(trial, ignore_errors=True)


def damage(flips: int, workdir: Path, tally, seed: int, parallel: int) -> None:
    """``flips`` single-byte flips (a fifth of them over portable files) plus truncations, swaps and deletions (each
    ``flips / 25``, at least 10), spread over ``parallel`` checkers."""
    from .run import Checker

    bases = build_bases(workdir)
    others = max(10, flips // 25)
    plan = ["flip"] * (flips - flips // 5) + ["portable"] * (flips // 5) + ["truncate", "swap", "delete"] * others
    random.Random(seed).shuffle(plan)
    checkers = [Checker(workdir) for _ in range(parallel)]

    def lane(i: int) -> None:
        rng = random.Random(seed * 31 + i)
        for t in range(i, len(plan), parallel):
            damage_trial(bases[t % len(bases)], plan[t], rng, workdir, checkers[i], tally, t)

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lane, range(parallel)))
    for c in checkers:
        c.close()


__all__ = ["GROUP_LABEL", "build_bases", "store_files", "damage_trial", "damage"]
