"""The soak's heal row: damage → detect → save → repair, then everything restores exactly or was reported lost.

Each trial builds a small store in which several sessions share chunks (the same content under different session
ids, and a grown session sharing its prefix), flips one byte inside the tensor data of a random chunk, restores
every session (a restore returning other bytes than the truth is **wrong**), re-saves one session with its true
content (which may heal the damaged copy for every session sharing it), runs ``repair`` and restores every session
again. A session must then restore exactly, or be named by ``repair`` (lost, or a dropped quarantine record) — a
session missing or failing without a report is **lost**; anything else raised is a **crash**. ``verify --deep``
must be clean after the repair.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

ROW = "heal: damage, detect, save, repair"


def _build(root: Path, kind: str, seed: int) -> dict[str, tuple[list[int], int, int]]:
    from kvshelf import open_store

    from .cases import CHUNK, IDENTITY, at_rest, make_caches, tokens_for

    truth = {}
    with open_store(root, identity=IDENTITY, chunk_tokens=CHUNK, **at_rest()) as store:
        for name, n, s in (("a", 48, seed), ("b", 48, seed), ("c", 48, seed), ("g", 80, seed), ("o", 48, seed + 1)):
            toks = tokens_for(kind, s, n)
            store.save(name, toks, make_caches(kind, n, s))
            truth[name] = (toks, n, s)
    return truth


def trial(workdir: Path, rng: random.Random, kind: str) -> tuple[str, list[str]]:
    from kvshelf import open_store
    from kvshelf.errors import KvShelfError

    from .cases import CHUNK, IDENTITY, at_rest, fingerprint, make_caches

    root = workdir / f"heal-{rng.randrange(1 << 30)}"
    try:
        truth = _build(root, kind, rng.randrange(1000))
        want = {name: fingerprint(make_caches(kind, n, s)) for name, (_t, n, s) in truth.items()}
        with open_store(root, identity=IDENTITY, chunk_tokens=CHUNK, **at_rest()) as store:
            chunks = sorted({h for h, _m in store.admin.iter_chunks()})
            victim = rng.choice(chunks)
            name, offset, length = store.admin.chunk_location(victim)
            path = store.bytes.path(name)
            with open(path, "r+b") as f:  # one byte inside the chunk's tensor data: same size, only a hash sees
                at = offset + length - 1 - rng.randrange(min(64, length // 4))
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
            detected = False
            for s in truth:
                try:
                    if fingerprint(store.restore(s).caches) != want[s]:
                        return "wrong", [f"{kind}: session {s} restored other bytes after the flip"]
                except KvShelfError:
                    detected = True
            healer = rng.choice(list(truth))
            toks, n, seed = truth[healer]
            store.save(healer, toks, make_caches(kind, n, seed))
            report = store.repair(dry_run=False)
            reported = {r["session_id"] for r in report.lost} | {q["session_id"] for q in report.dropped_quarantined}
            for s in truth:
                try:
                    got = fingerprint(store.restore(s).caches)
                except KvShelfError as exc:
                    if s in reported:
                        continue
                    return "lost", [f"{kind}: session {s} unreadable after repair, not reported: {exc}"]
                if got != want[s]:
                    return "wrong", [f"{kind}: session {s} restored other bytes after repair"]
            found = store.verify(deep=True)
            if found:
                return "lost", [f"{kind}: verify after repair: {found[0].kind}: {found[0].detail}"]
        return ("detected" if detected else "exact"), [f"{kind}: chunk {victim[:12]} flipped"]
    except Exception as exc:  # noqa: BLE001 - the soak's verdict: a crash, never an escape
        return "crash", [f"{kind}: {type(exc).__name__}: {exc}"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def heal(trials: int, workdir: Path, tally, seed: int) -> None:
    from .cases import KINDS

    rng = random.Random(seed ^ 0x4EA1)
    for t in range(trials):
        status, notes = trial(workdir, rng, KINDS[t % len(KINDS)])
        tally.add(ROW, status, notes)


__all__ = ["ROW", "heal", "trial"]
