"""The soak's subprocesses: ``python -m tests.soak --worker NAME ...`` runs one of these.

* ``checker``: reads JSON requests on stdin (check a store directory or a portable file against the truth), answers
  one JSON line each. A signal death (SIGBUS from a damaged map, a segfault) ends the process: the driver counts it
  as a crash and starts another.
* ``writer``: a plan of saves (sync and async, every cache kind) and deletes, logged as ``saving``/``saved`` lines
  (a line is written only after the call returned: durable) so the driver can tell committed from in flight. It is
  killed with SIGKILL by the driver at a random moment, or kills itself at an injected point (``--kill-at
  write:3``: the third ``os.write*`` call; points ``write``, ``fsync``, ``rename``, ``renamed``, ``unlink``, and —
  where the store has them — ``commit``/``committed`` around the index write transaction). The points wrap ``os``
  functions in this process only: no store code knows about them, so they work on any store layout.
* ``mixed``: one of four processes of mixed traffic (saves, restores of its own and others' sessions, lookups,
  prefix and batch restores, deletes, gc, verify) for some seconds; reports counts as JSON.
* ``enospc``: saves into a store on a small filesystem until it is full (``StoreFull``), checks that everything
  saved before still restores exactly, deletes half and goes again (three rounds).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from kvshelf import open_store
from kvshelf.codecs import load_snapshot
from kvshelf.errors import KvShelfError, SnapshotNotFound, StoreFull

from .cases import (
    at_rest,
    CHUNK,
    IDENTITY,
    KINDS,
    Verdict,
    check_restored,
    check_store,
    fingerprint,
    make_caches,
    prefix_reads,
    tokens_for,
    truth_fingerprint,
    truth_of,
    truth_prefix,
)

OS_POINTS = {"write": ("write", "writev", "pwrite", "pwritev"), "fsync": ("fsync", "fdatasync"),
             "rename": ("rename", "replace"), "renamed": ("rename", "replace"), "unlink": ("unlink",)}
INDEX_POINTS = ("commit", "committed")


# ---------------------------------------------------------------------------------------------------- checker
def check_portable(path: str, truth: list) -> Verdict:
    out = Verdict()
    kind, seed, n = truth
    try:
        snap = load_snapshot(path)
    except KvShelfError as exc:
        out.worse("detected", f"{type(exc).__name__}: {exc}")
        return out
    except Exception as exc:  # noqa: BLE001 - what the soak counts
        out.worse("crash", f"{type(exc).__name__}: {exc}")
        return out
    if snap.tokens != tokens_for(kind, seed, n) or fingerprint(snap.caches) != truth_fingerprint(kind, seed, n):
        out.worse("wrong", f"portable file loaded without error but differs from {kind}/{seed}/{n}")
    return out


def run_checker() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "portable":
                v = check_portable(req["path"], req["truth"])
            else:
                v = check_store(req["root"], req["sessions"], damaged=req["damaged"], rebuild=req.get("rebuild", False),
                                deep=req.get("deep", True), prefix=req.get("prefix", True))
                if req.get("gc") and v.status != "crash":
                    with open_store(req["root"], admin=True, **at_rest()) as admin:
                        admin.gc(dry_run=False)
        except KvShelfError as exc:
            v = Verdict()
            v.worse("detected", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001
            v = Verdict()
            v.worse("crash", f"{type(exc).__name__}: {exc}: {traceback.format_exc(limit=3)}")
        sys.stdout.write(json.dumps({"status": v.status, "notes": v.notes, "present": v.present}) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------------------------------------------- writer
def install_kill_point(spec: str) -> bool:
    """Arrange for SIGKILL at the k-th hit of ``point``; False when this store has no such point."""
    point, k = spec.split(":")
    hits = [0]

    def hit() -> None:
        hits[0] += 1
        if hits[0] >= int(k):
            os.kill(os.getpid(), signal.SIGKILL)

    if point in OS_POINTS:
        for name in OS_POINTS[point]:
            real = getattr(os, name, None)
            if real is None:
                continue

            def wrapped(*args, _real=real, **kwargs):
                if point != "renamed":
                    hit()
                result = _real(*args, **kwargs)
                if point == "renamed":
                    hit()
                return result

            setattr(os, name, wrapped)
        return True
    try:
        from kvshelf.store.index import lmdb_env as index_module
        write = index_module.Index.write
    except (ImportError, AttributeError):
        return False

    def write_with_kill(self, fn):
        if point == "commit":
            return write(self, lambda txn: (fn(txn), hit())[0])  # inside the transaction, before it commits
        result = write(self, fn)
        hit()
        return result

    index_module.Index.write = write_with_kill
    return True


def run_writer(store: str, seed: int, log: str, kill_at: str | None, steps: int = 24) -> None:
    rng = random.Random(seed)
    lock = threading.Lock()
    logf = open(log, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives until the kill

    def say(text: str) -> None:
        with lock:
            logf.write(text + "\n")
            logf.flush()

    if kill_at and not install_kill_point(kill_at):
        say("nopoint")
    with open_store(store, identity=IDENTITY, chunk_tokens=CHUNK, **at_rest()) as s:
        say("ready")
        for _ in range(steps):
            sid, ns = f"w{rng.randrange(6)}", rng.choice(["", "", "t"])
            if rng.random() < 0.12:
                s.flush()
                say(f"deleting {ns or '-'} {sid}")
                try:
                    s.delete(sid, namespace=ns)
                except SnapshotNotFound:
                    pass
                say(f"deleted {ns or '-'} {sid}")
                continue
            kind, n, vseed = rng.choice(KINDS), rng.randrange(20, 120), rng.randrange(2**30)
            what = f"{ns or '-'} {sid} {kind} {vseed} {n}"
            caches, tokens = make_caches(kind, n, vseed), tokens_for(kind, vseed, n)
            # issue 22: a kill may land between a session's commit and its checkpoint's
            more = {"checkpoints": {n // 2: make_caches(kind, n // 2, vseed)}} if rng.random() < 0.3 else {}
            s.flush()  # one pending operation per session at most: the order of commits is the order of calls
            say(f"saving {what}")
            if rng.random() < 0.4:
                fut = s.save_async(sid, tokens, caches, namespace=ns, **more)
                fut.add_done_callback(lambda f, w=what: say(("saved " if f.exception() is None else "failed ") + w))
            else:
                try:
                    s.save(sid, tokens, caches, namespace=ns, **more)
                    say(f"saved {what}")
                except KvShelfError as exc:
                    say(f"failed {what} {type(exc).__name__}")
        s.flush()
    say("done")


def replay(lines: list[str], prior: dict[str, list | None]) -> dict[str, list]:
    """Acceptable versions per "ns/sid" after a writer's log: the last completed operation's result, plus the
    operation in flight when the process died (its commit may or may not have happened)."""
    acceptable = {key: [v] for key, v in prior.items()}
    for line in lines:
        parts = line.split()
        if not parts or parts[0] not in ("saving", "saved", "deleting", "deleted", "failed"):
            continue
        key = f"{'' if parts[1] == '-' else parts[1]}/{parts[2]}"
        version = [parts[3], int(parts[4]), int(parts[5])] if parts[0] in ("saving", "saved", "failed") else None
        if parts[0] in ("saving", "deleting"):
            acceptable.setdefault(key, [None]).append(version)  # in flight: either outcome is fine
        elif parts[0] in ("saved", "deleted"):
            acceptable[key] = [version]
        else:  # failed: refused, nothing committed — the state before it stands
            acceptable[key] = [v for v in acceptable[key] if v != version] or [None]
    return acceptable


# ---------------------------------------------------------------------------------------------------- mixed traffic
def run_mixed(store: str, wid: int, seed: int, seconds: float, out: str) -> None:
    rng = random.Random(seed)
    counts = {"ops": 0, "detected": 0, "exact": 0, "wrong": 0, "crashes": 0, "lost": 0, "notes": []}
    own: dict[str, list] = {}

    def note(kind: str, text: str) -> None:
        counts[kind] += 1
        if len(counts["notes"]) < 6:
            counts["notes"].append(f"{kind}: {text}"[:300])

    deadline = time.monotonic() + seconds
    with open_store(store, identity=IDENTITY, chunk_tokens=CHUNK, **at_rest()) as s:
        while time.monotonic() < deadline:
            counts["ops"] += 1
            op, sid = rng.random(), f"m{wid}-{rng.randrange(4)}"
            try:
                if op < 0.3 or sid not in own:
                    kind, n, vseed = KINDS[(wid + 4 * rng.randrange(3)) % len(KINDS)], rng.randrange(20, 100), rng.randrange(2**30)
                    args = (sid, tokens_for(kind, vseed, n), make_caches(kind, n, vseed))
                    # issue 22: some saves carry a checkpoint at n // 2 (the caches of the first n // 2 rows)
                    more = {"checkpoints": {n // 2: make_caches(kind, n // 2, vseed)}} if rng.random() < 0.3 else {}
                    s.save(*args, **more) if rng.random() < 0.6 else (s.save_async(*args, **more), s.flush())
                    own[sid] = [kind, vseed, n]
                elif op < 0.5:
                    problem = check_restored(s.restore(sid), [own[sid]])
                    note("wrong", f"own {sid}: {problem}") if problem else None
                elif op < 0.65:
                    others = s.sessions()
                    if others:
                        other = rng.choice(others)
                        try:
                            r = s.restore(other.session_id)
                        except SnapshotNotFound:
                            continue  # deleted or replaced by its owner meanwhile
                        claimed = truth_of(r.tokens)
                        problem = "unknown tokens" if claimed is None else check_restored(r, [[*claimed, len(r.tokens)]])
                        note("wrong", f"other {other.session_id}: {problem}") if problem else None
                elif op < 0.8:
                    kind, vseed, n = own[sid]
                    prompt = [*tokens_for(kind, vseed, n)[: rng.randrange(2, n)], 2**31 - 1]
                    if rng.random() < 0.3:  # a checkpoint's own length (issue 22): restored exactly, not cut
                        prompt = [*tokens_for(kind, vseed, n)[: n // 2], 2**31 - 1]
                    r = s.restore_prefix(prompt)
                    if r is not None and r.tokens != prompt[: r.length]:
                        note("wrong", f"prefix restore tokens are not a prefix of the prompt ({sid})")
                    elif r is not None and (k := {c.snapshot_id: c.length for c in s.list_checkpoints(sid)}.get(
                            r.snapshot_id)) is not None:
                        if r.length == k:  # the checkpoint whole: every stored byte is the truth's
                            problem = check_restored(r, [[kind, vseed, r.length]])
                        else:  # a trimmable checkpoint cut shorter: what the cut reads (a ring's layout differs)
                            want = truth_prefix(kind, vseed, r.length)
                            problem = None if want is None or prefix_reads(kind, r.caches) == want else \
                                f"cut of checkpoint {k} to {r.length} reads other values than {kind}/{vseed}"
                        note("wrong", f"checkpoint of {sid}: {problem}") if problem else None
                elif op < 0.88:
                    b = s.restore_batch([sid, sid])
                    if b.tokens != [tokens_for(*own[sid][:2], own[sid][2])] * 2:
                        note("wrong", f"batch rows of {sid} have other tokens")
                elif op < 0.95:
                    s.delete(sid)
                    del own[sid]
                    if s.list_checkpoints(sid):
                        note("wrong", f"a checkpoint outlived its session {sid}")
                elif op < 0.98:
                    s.gc(dry_run=False)
                else:
                    s.verify(deep=False)
            except SnapshotNotFound as exc:
                note("lost", f"own {sid}: {exc}")
            except KvShelfError as exc:
                note("detected", f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001
                note("crashes", f"{type(exc).__name__}: {exc}: {traceback.format_exc(limit=4)}")
        for sid, version in own.items():  # at the end every own session restores exactly
            try:
                problem = check_restored(s.restore(sid), [version])
                note("wrong", f"own {sid} at the end: {problem}") if problem else None
            except KvShelfError as exc:
                note("lost", f"own {sid} at the end: {type(exc).__name__}: {exc}")
    counts["exact"] = counts["ops"] - sum(counts[k] for k in ("detected", "wrong", "crashes", "lost"))
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(counts, fh)


# ---------------------------------------------------------------------------------------------------- ENOSPC
def make_room(s, saved: dict) -> None:
    """Delete half the saved sessions and gc, so the next round can fill the disk again."""
    for sid in list(saved)[: max(1, len(saved) // 2)]:
        s.delete(sid)
        del saved[sid]
    s.gc(dry_run=False)


def run_enospc(store: str, out: str, rounds: int = 3) -> None:
    counts = {"trials": 0, "detected": 0, "exact": 0, "wrong": 0, "crashes": 0, "lost": 0, "full": 0, "notes": []}
    saved: dict[str, list] = {}
    rng = random.Random(5)
    ballast = Path(store).parent / "ballast"  # space an operator could free on this filesystem, outside the store
    ballast.write_bytes(b"\0" * (768 << 10))
    with open_store(store, identity=IDENTITY, chunk_tokens=CHUNK, **at_rest()) as s:
        k = 0
        for _round in range(rounds):
            for _ in range(400):  # until the filesystem is full
                kind, n, vseed = rng.choice(KINDS), rng.randrange(60, 200), rng.randrange(2**30)
                sid, k = f"e{k}", k + 1
                counts["trials"] += 1
                try:
                    s.save(sid, tokens_for(kind, vseed, n), make_caches(kind, n, vseed))
                    saved[sid] = [kind, vseed, n]
                    counts["exact"] += 1
                except StoreFull:
                    counts["detected"] += 1
                    counts["full"] += 1
                    break
                except KvShelfError as exc:
                    counts["detected"] += 1
                    counts["notes"].append(f"{type(exc).__name__}: {exc}"[:200])
                except Exception as exc:  # noqa: BLE001
                    counts["crashes"] += 1
                    counts["notes"].append(f"crash {type(exc).__name__}: {exc}"[:300])
            for sid, version in saved.items():  # a full disk loses nothing that was saved
                try:
                    problem = check_restored(s.restore(sid), [version])
                    if problem:
                        counts["wrong"] += 1
                        counts["notes"].append(f"wrong {sid}: {problem}")
                except KvShelfError as exc:
                    counts["lost"] += 1
                    counts["notes"].append(f"lost {sid}: {type(exc).__name__}: {exc}"[:200])
            try:  # make room; the next round must be able to use it
                make_room(s, saved)
            except StoreFull as exc:
                # LMDB is copy-on-write: on a disk this full even a delete needs pages; the store's reserve makes
                # that rare, not impossible (how many pages depends on the random snapshot ids). The guarantee is a
                # clean StoreFull that loses nothing: free the disk as an operator would (the ballast beside the
                # store), make room again, and the next check restores every session saved so far.
                counts["detected"] += 1
                counts["notes"].append(f"full while making room (ballast freed): {exc}"[:200])
                ballast.unlink(missing_ok=True)
                make_room(s, saved)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(counts, fh)


__all__ = ["run_checker", "run_writer", "replay", "run_mixed", "run_enospc", "install_kill_point", "INDEX_POINTS",
           "OS_POINTS"]
