"""An adversarial soak of the store you can run: ``python -m tests.soak --kills N --flips N --seconds N``.

What it does (only the public API plus raw file operations on the store directory, so it runs on any layout):

* **kill -9**: a writer subprocess (saves of every cache kind, sync and async, and deletes) is killed at a random
  moment or kills itself at an injected point (the k-th write/fsync/rename/unlink, before/after the index commit —
  see ``workers``); then every session must restore as it was committed (a save logged as returned is
  durable; the one in flight may or may not be there). Missing or unreadable committed data is **lost**.
* **damage** (``damage``): single-byte flips over every file of a small store (chunk bytes, blob headers,
  manifest files — also followed by ``rebuild_index`` — and LMDB's ``data.mdb``) and over portable snapshot files;
  truncations, swaps and deletions of files. Every session is then restored (and a prefix of it), the store verified.
* **heal** (``heal``): a byte flipped in a chunk shared by several sessions; every session restored (detected or
  exact, never wrong), one re-saved, ``repair`` run: every session then restores exactly or was reported lost by
  repair, and ``verify --deep`` is clean.
* **mixed**: 4 processes of mixed traffic on one store for ``--seconds``.
* **ENOSPC**: saves into a store on a 3 MiB tmpfs until it is full (where ``mount -t tmpfs`` is allowed), and with
  the blob layer's injected ENOSPC (``KVSHELF_FAULT_ENOSPC_AFTER``) everywhere.

Each trial is **exact** (everything equals the truth the soak keeps), **detected** (a ``KvShelfError`` said so),
**wrong** (data or tokens differ from the truth without an error), **crash** (another exception, or a signal death)
or **lost**. The exit code is 1 when any trial is wrong, crashed or lost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: ``tests.soak`` is importable from it
COLUMNS = ("trials", "detected", "exact", "wrong", "crashes", "lost")
POINTS = ("random", "write", "fsync", "rename", "renamed", "unlink", "commit", "committed")


def _worker_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.soak", "--worker", *args]


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


class Tally:
    """One row per kind of trial; ``add`` takes a verdict status."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}
        self.notes: dict[str, list[str]] = {}
        self.samples: dict[str, list[str]] = {}  # what detections said (printed with --verbose)
        self.seconds: dict[str, float] = {}
        self.lock = threading.Lock()

    def add(self, row: str, status: str, notes: list[str] = (), n: int = 1) -> None:
        column = {"exact": "exact", "detected": "detected", "wrong": "wrong", "crash": "crashes", "lost": "lost"}[status]
        with self.lock:
            counts = self.rows.setdefault(row, dict.fromkeys(COLUMNS, 0))
            counts["trials"] += n
            counts[column] += n
            if status in ("wrong", "crash", "lost"):
                kept = self.notes.setdefault(row, [])
                kept.extend(notes[: max(0, 3 - len(kept))])
            elif status == "detected":
                kept = self.samples.setdefault(row, [])
                kept.extend(notes[: max(0, 2 - len(kept))])

    def merge(self, row: str, counts: dict) -> None:
        with self.lock:
            into = self.rows.setdefault(row, dict.fromkeys(COLUMNS, 0))
            for c in COLUMNS:
                into[c] += counts.get(c, 0)
            bad = [n for n in counts.get("notes", []) if not n.startswith("detected")]
            self.notes.setdefault(row, []).extend(bad[:3])

    def failures(self) -> int:
        return sum(r["wrong"] + r["crashes"] + r["lost"] for r in self.rows.values())

    def table(self, verbose: bool = False) -> str:
        lines = [f"{'trial':<44}" + "".join(f"{c:>10}" for c in COLUMNS)]
        total = dict.fromkeys(COLUMNS, 0)
        for row, counts in sorted(self.rows.items(), key=lambda item: (not item[0].startswith("kill"), item[0])):
            lines.append(f"{row:<44}" + "".join(f"{counts[c]:>10}" for c in COLUMNS))
            for c in COLUMNS:
                total[c] += counts[c]
        lines.append(f"{'total':<44}" + "".join(f"{total[c]:>10}" for c in COLUMNS))
        for row, notes in self.notes.items():
            for note in notes[:3]:
                lines.append(f"  {row}: {note}")
        if verbose:
            lines += [f"  (detected) {row}: {note}" for row, notes in self.samples.items() for note in notes]
            lines.append("  seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items()))
        return "\n".join(lines)


class Checker:
    """A checker subprocess (JSON lines); a signal death is a crash of that trial, and a new checker starts."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.proc = workdir, None

    def _start(self) -> None:
        err = open(self.workdir / f"checker-{id(self)}.err", "a")  # noqa: SIM115
        self.proc = subprocess.Popen(_worker_cmd("checker"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err, text=True, cwd=ROOT, env=_env())
        err.close()

    def run(self, request: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            self.proc = None
            what = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            return {"status": "crash", "notes": [f"checker died ({what}) on {request.get('what', '')}"], "present": {}}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# ---------------------------------------------------------------------------------------------------- kill -9
def kill_lane(lane: int, kills: int, workdir: Path, tally: Tally, rng: random.Random) -> None:
    from .workers import replay

    checker, landed, runs = Checker(workdir), 0, 0
    truth: dict[str, list | None] = {}
    store = None
    while landed < kills:
        if runs % 8 == 0:
            store, truth = workdir / f"kill-{lane}-{runs}", {}
        point = POINTS[runs % len(POINTS)]
        log = workdir / f"writer-{lane}-{runs}.log"
        args = ["writer", "--store", str(store), "--seed", str(rng.randrange(2**31)), "--log", str(log)]
        if point != "random":
            args += ["--kill-at", f"{point}:{rng.randrange(1, 40)}"]
        runs += 1
        proc = subprocess.Popen(_worker_cmd(*args), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if point == "random" or _wait_line(log, "nopoint", proc, quick=True):
            if _wait_lines(log, rng.randrange(1, 40), proc):  # somewhere in the plan, then a random instant
                time.sleep(rng.uniform(0.0, 0.03))
            if proc.poll() is None:
                proc.kill()
        _out, err = proc.communicate(timeout=300)
        lines = log.read_text().splitlines() if log.exists() else []
        row = f"kill -9 ({point})"
        if proc.returncode not in (0, -signal.SIGKILL):
            tally.add(row, "crash", [f"writer exit {proc.returncode}: {err.strip()[-400:]}"])
        acceptable = replay(lines, truth)
        sessions = [[k.split("/")[0], k.split("/")[1], v, None not in v] for k, v in acceptable.items()]
        verdict = checker.run({"op": "store", "root": str(store), "sessions": sessions, "damaged": False,
                               "gc": runs % 3 == 0, "deep": True, "what": row})
        if proc.returncode == -signal.SIGKILL:
            landed += 1
            tally.add(row, verdict["status"], verdict["notes"])
        elif verdict["status"] != "exact":
            tally.add(f"{row}: finished", verdict["status"], verdict["notes"])
        truth = {k: verdict["present"].get(k) for k in acceptable}
    checker.close()


def _wait_lines(log: Path, count: int, proc: subprocess.Popen) -> bool:
    """Wait until the writer logged ``count`` lines (True) or ended (False)."""
    while proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= count:
            return True
        time.sleep(0.002)
    return False


def _wait_line(log: Path, text: str, proc: subprocess.Popen, quick: bool = False) -> bool:
    """Wait until the writer logged ``text`` (True) or ended; ``quick``: only look once it logged anything."""
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        if text in lines:
            return True
        if proc.poll() is not None or (quick and lines):
            return False
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------------------- mixed, ENOSPC
def mixed(seconds: float, workdir: Path, tally: Tally, seed: int) -> None:
    store = workdir / "mixed"
    procs = [subprocess.Popen(_worker_cmd("mixed", "--store", str(store), "--wid", str(w), "--seed", str(seed + w),
                                          "--seconds", str(seconds), "--out", str(workdir / f"mixed-{w}.json")),
                              cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True) for w in range(4)]
    for w, proc in enumerate(procs):
        _out, err = proc.communicate(timeout=seconds + 600)
        out = workdir / f"mixed-{w}.json"
        if proc.returncode != 0 or not out.exists():
            tally.add("mixed traffic, 4 processes", "crash", [f"process {w} exit {proc.returncode}: {err[-400:]}"])
            continue
        counts = json.loads(out.read_text())
        counts["trials"] = counts["ops"]
        tally.merge("mixed traffic, 4 processes", counts)


def enospc(workdir: Path, tally: Tally) -> str | None:
    """Real ENOSPC on a 3 MiB tmpfs (skipped, with the reason, where mount is refused) and the injected one."""
    skipped = None
    mnt = workdir / "tmpfs"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)],
                           capture_output=True, text=True, check=False)
    runs = [("ENOSPC injected (KVSHELF_FAULT_ENOSPC_AFTER)", workdir / "enospc-injected",
             {"KVSHELF_FAULT_ENOSPC_AFTER": "400000"})]
    if mount.returncode == 0:
        runs.append(("ENOSPC real (3 MiB tmpfs)", mnt / "store", {}))
    else:
        skipped = f"real ENOSPC skipped: mount -t tmpfs refused ({mount.stderr.strip() or mount.returncode})"
    try:
        for row, store, env in runs:
            out = workdir / f"{store.name}.json"
            proc = subprocess.run(_worker_cmd("enospc", "--store", str(store), "--out", str(out)), cwd=ROOT,
                                  env={**_env(), **env}, capture_output=True, text=True, timeout=900, check=False)
            if proc.returncode != 0 or not out.exists():
                tally.add(row, "crash", [f"exit {proc.returncode}: {proc.stderr[-400:]}"])
                continue
            tally.merge(row, json.loads(out.read_text()))
    finally:
        if mount.returncode == 0:
            subprocess.run(["umount", str(mnt)], capture_output=True, check=False)
    return skipped


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=100, help="kill -9 trials that land before the writer finishes")
    p.add_argument("--flips", type=int, default=2000, help="single-byte flips (80%% store files, 20%% portable)")
    p.add_argument("--heals", type=int, default=40, help="heal trials: damage, detect, save, repair (0: skip)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of 4-process mixed traffic (0: skip)")
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--parallel", type=int, default=2, help="kill lanes and damage checkers run side by side")
    p.add_argument("--no-enospc", action="store_true")
    p.add_argument("--encrypted", action="store_true",
                   help="every store encrypted at rest (open_store key=): the same trials against sealed chunks")
    p.add_argument("--workdir", type=Path, default=None,
                   help="default: a temporary directory (in /dev/shm when writable), removed at the end")
    p.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    p.add_argument("--verbose", action="store_true", help="also print what detections said and time per part")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    for worker_option in ("--store", "--log", "--kill-at", "--out"):
        p.add_argument(worker_option, help=argparse.SUPPRESS)
    p.add_argument("--wid", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.encrypted:  # inherited by every worker process of the run
        from .cases import SOAK_KEY_VAR

        os.environ[SOAK_KEY_VAR] = (bytes(range(32))).hex()
    if args.worker:
        return _run_worker(args)
    # on tmpfs when there is one: kill -9 keeps the page cache anyway, and a store's fsyncs cost nothing there
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvshelf-soak-", dir=shm))
    workdir.mkdir(parents=True, exist_ok=True)
    tally, started, rng = Tally(), time.monotonic(), random.Random(args.seed)
    def timed(name: str, t0: float) -> float:
        tally.seconds[name] = time.monotonic() - t0
        return time.monotonic()

    t = time.monotonic()
    try:
        if args.kills:
            per = -(-args.kills // args.parallel)
            lanes = [threading.Thread(target=kill_lane, args=(i, per, workdir, tally, random.Random(rng.random())))
                     for i in range(args.parallel)]
            for lane in lanes:
                lane.start()
            for lane in lanes:
                lane.join()
            t = timed("kills", t)
        if args.flips:
            from .damage import damage

            damage(args.flips, workdir, tally, args.seed, args.parallel)
            t = timed("damage", t)
        if args.heals:
            from .heal import heal

            heal(args.heals, workdir, tally, args.seed)
            t = timed("heal", t)
        if args.seconds:
            mixed(args.seconds, workdir, tally, args.seed)
            t = timed("mixed", t)
        skipped = None if args.no_enospc else enospc(workdir, tally)
        timed("enospc", t)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(tally.table(args.verbose))
    if skipped:
        print(skipped)
    print(f"{time.monotonic() - started:.0f} s; exit {1 if tally.failures() else 0} "
          f"({tally.failures()} wrong/crashed/lost)")
    if args.json:
        args.json.write_text(json.dumps({"rows": tally.rows, "notes": tally.notes, "skipped": skipped}, indent=2))
    return 1 if tally.failures() else 0


def _run_worker(args) -> int:
    from . import workers as w

    if args.worker == "checker":
        w.run_checker()
    elif args.worker == "writer":
        w.run_writer(args.store, args.seed, args.log, args.kill_at)
    elif args.worker == "mixed":
        w.run_mixed(args.store, args.wid, args.seed, args.seconds, args.out)
    elif args.worker == "enospc":
        w.run_enospc(args.store, args.out)
    return 0

