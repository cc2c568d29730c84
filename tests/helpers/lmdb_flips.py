"""Byte flips of a real store's ``data.mdb``, each opened in a subprocess that may die by a signal.

LMDB trusts its pages: a damaged one can kill the reading process (SIGBUS through the map, SIGSEGV, an assertion's
SIGABRT) before Python sees anything, so the only honest test of "never a dead process" runs the damaged open in a
child and looks at how the child ended. ``run_flips(pristine, flips, workdir)`` sends ``(offset, xor mask)`` pairs
to a child (``python -m tests.helpers.lmdb_flips STORE WORKDIR``); for each one the child copies the pristine
``data.mdb`` over its own copy of the store, flips the byte, opens the store, lists it, looks up every session,
restores (whole and by prefix) some and deep-verifies, and answers one JSON line: ``ok``,
``detected: <KvShelfError class>: ...`` or ``raised: ...`` (any other exception). A child that dies answers nothing;
the harness records ``signal <NAME>`` for that flip and starts a new child for the rest — so a batch of hundreds of
flips costs a handful of interpreter starts, not hundreds.

Only ``index/data.mdb`` is replaced per flip: the packs are shared by the trials (nothing here deletes or rewrites a
pack: no gc, no repack), so a trial costs one copy of a ~1.4 MiB file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: ``tests.helpers`` is importable from it
SESSIONS = 96  # > 78 snapshots on one boundary: its dupsort values outgrow a sub-page into a sub-database


def build_store(root: Path) -> dict:
    """A small store whose ``data.mdb`` holds every page shape LMDB writes for kvshelf: several leaves under a branch
    page (many sessions), overflow pages (long token records), dupsort values as sub-pages and as a sub-database
    (many snapshots sharing one prefix boundary), two namespaces and a deleted session (free pages). Returns what
    the child needs: ``{"sessions": [[namespace, session_id, n_tokens], ...]}``."""
    from ..soak.cases import CHUNK, IDENTITY, make_caches, tokens_for
    from kvshelf import open_store

    sessions = []
    shared = tokens_for("kv", 0, 2 * CHUNK)
    with open_store(root, identity=IDENTITY, chunk_tokens=CHUNK) as store:
        for i in range(SESSIONS):
            n, ns = (300 if i % 32 == 0 else 40 + i % 5), ("t" if i % 9 == 4 else "")
            toks = shared + tokens_for("kv", i + 1, n)[2 * CHUNK:]
            store.save(f"s{i}", toks, make_caches("kv", n, i), namespace=ns)
            sessions.append([ns, f"s{i}", n])
        store.save("gone", tokens_for("rotating", 9, 40), make_caches("rotating", 40, 9), namespace="t")
        store.delete("gone", namespace="t")
    return {"sessions": sessions}


def run_flips(pristine: Path, flips: list[tuple[int, int]], workdir: Path, timeout: float = 600) -> list[str]:
    """The outcome of each ``(offset, mask)`` flip of ``pristine/index/data.mdb``, in order."""
    outcomes: list[str] = []
    while len(outcomes) < len(flips):
        rest = flips[len(outcomes):]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        child = subprocess.Popen([sys.executable, "-m", "tests.helpers.lmdb_flips", str(pristine), str(workdir)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=ROOT, env=env)
        lines, err = child.communicate("".join(json.dumps(f) + "\n" for f in rest), timeout=timeout)
        got = [json.loads(line)["outcome"] for line in lines.splitlines() if line.startswith("{")]
        outcomes.extend(got)
        if len(outcomes) < len(flips):  # the child died on the next flip
            rc = child.returncode
            outcomes.append(f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}: {err.strip()[-300:]}")
    return outcomes


def _trial(pristine: Path, trial: Path, sessions: list, offset: int, mask: int) -> str:
    from kvshelf import open_store
    from kvshelf.errors import KvShelfError

    from ..soak.cases import CHUNK, IDENTITY, tokens_for

    data = bytearray((pristine / "index" / "data.mdb").read_bytes())
    data[offset] ^= mask
    shutil.rmtree(trial / "index", ignore_errors=True)
    (trial / "index").mkdir(mode=0o700)
    (trial / "index" / "data.mdb").write_bytes(bytes(data))
    try:
        with open_store(trial, identity=IDENTITY, chunk_tokens=CHUNK) as store:
            listed = store.sessions(namespace=None)
            for i, (ns, sid, n) in enumerate(sessions):  # every index record is read by the lookups and verify
                try:
                    store.lookup([*tokens_for("kv", 0, 2 * CHUNK), *tokens_for("kv", i + 1, n)[2 * CHUNK:n]],
                                 namespace=ns)
                    if i % 12 == 0:  # whole restores and prefix restores of a few (the long ones among them)
                        r = store.restore(sid, namespace=ns)
                        store.restore_prefix([*r.tokens[: len(r.tokens) // 2], 2**31 - 1], namespace=ns)
                except KvShelfError:
                    pass  # detected for this session; the others still run
            store.verify(deep=True)
        return f"ok ({len(listed)} listed)"
    except KvShelfError as exc:
        return f"detected: {type(exc).__name__}: {exc}"[:400]
    except Exception as exc:  # noqa: BLE001 - what the test counts
        return f"raised: {type(exc).__name__}: {exc}"[:400]


def _child(pristine: Path, workdir: Path) -> None:
    meta = json.loads((pristine.parent / f"{pristine.name}.json").read_text())
    trial = workdir / f"trial-{os.getpid()}"
    if not trial.exists():
        shutil.copytree(pristine, trial)
    for line in sys.stdin:
        offset, mask = json.loads(line)
        outcome = _trial(pristine, trial, meta["sessions"], offset, mask)
        sys.stdout.write(json.dumps({"outcome": outcome}) + "\n")
        sys.stdout.flush()
    shutil.rmtree(trial, ignore_errors=True)


def make_pristine(workdir: Path) -> Path:
    """``workdir/pristine`` built once, with its session list beside it (``pristine.json``)."""
    pristine = workdir / "pristine"
    if not pristine.exists():
        meta = build_store(pristine)
        (workdir / "pristine.json").write_text(json.dumps(meta))
    return pristine


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
