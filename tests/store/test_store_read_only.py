"""A store this process cannot write opens read-only: every read works, every write raises ``StoreReadOnly`` naming
the path and the missing permission, and nothing in the store changes (every file hashed before and after).

Two real setups: a store owned by root opened by ``nobody`` (``setpriv``; ``nobody`` keeps CAP_DAC_READ_SEARCH so it
can reach the interpreter and the test's directories, which are root's 0700 ones: it reads everything and writes
nothing), and the same store through a read-only bind mount (EROFS). The tests run as root, as CI does. A store of
an older index format (the committed ``tests/data`` stores) is read as it is, never upgraded: that is its owner's
next open's (``store/index/legacy_view.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tools_data import MODEL, private_copy, reads, template_store, tokens_for

from kvshelf import Identity, open_store
from kvshelf.store.index.lmdb_env import INDEX_FORMAT

PROBE = Path(__file__).resolve().parents[1] / "helpers" / "read_only_probe.py"
ROOT_PROJECT = Path(__file__).resolve().parents[2]
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=+dac_read_search",
             "--ambient-caps=+dac_read_search"]
READ_VERBS = [["ls"], ["show", "s-mla"], ["stats"], ["verify", "--deep"], ["export", "s-mla", "{out}/cli.kvs"],
              ["compact", "--dry-run"], ["repair", "--dry-run"], ["quarantine", "ls"]]  # dry runs write nothing
# each write verb, and the operation its refusal names: the one the user ran (compact's first write is a gc)
WRITE_VERBS = [(["gc", "--json"], "gc"), (["compact", "--json"], "compact"), (["repair", "--json"], "repair"),
               (["rebuild-index", "--json"], "rebuild_index"), (["import", "{out}/s-mla.kvs", "--session", "again", "--json"], "import")]
DATA = ROOT_PROJECT / "tests" / "data"
OLDER = {"format1": ("v1_store", "mla-f32"), "format2": ("v2_index_store", "chat")}  # committed store, a session

pytestmark = pytest.mark.host_feature("root")  # to own the store and to drop to nobody


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return template_store(tmp_path_factory, "readonly", kinds=("mla",), other_identity=False)


def _tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``root``: its mode and, for files, the sha256 of its bytes."""
    out = {}
    for base, dirs, files in os.walk(root):
        out[os.path.relpath(base, root)] = ("dir", os.stat(base).st_mode)
        for f in files:
            p = os.path.join(base, f)
            out[os.path.relpath(p, root)] = (hashlib.sha256(Path(p).read_bytes()).hexdigest(), os.stat(p).st_mode)
    return out


def _owner_view(template: Path, tmp_path: Path) -> dict:
    """What the store's owner reads (on a copy of its own)."""
    with open_store(private_copy(template, tmp_path / "owner"), identity=MODEL) as store:
        hit = store.lookup(tokens_for(70, 1) + [7, 8, 9])  # first: the owner's restore below is a use that
        # reorders the lookup's ties; a read-only reader remembers no use (store/access.py)
        return {"lookup": [hit.session_id, hit.length], "sessions": sorted(s.session_id for s in store.sessions(None)),
                "restore": [hashlib.sha256(a.tobytes()).hexdigest() for a in reads(store.restore("s-mla").caches)]}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT_PROJECT), "KVSHELF_NO_PROGRESS": "1", "COLUMNS": "500",
            "HOME": "/tmp"}


def _run(prefix: list[str], args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, *args], capture_output=True, text=True, env=_env(), timeout=300)


def _check(store: Path, out: Path, prefix: list[str], permission: str, owner: dict) -> None:
    proc = _run(prefix, [str(PROBE), str(store), str(out)])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["read_only"] is True
    assert doc["sessions"] == owner["sessions"] and doc["restore"] == owner["restore"]
    assert doc["restore_prefix"] == owner["restore"] and doc["lookup"] == owner["lookup"]
    assert doc["restore_batch"] == [70, 70] and doc["verify_deep"] == [] and doc["export"] and doc["repair_dry_run"]
    _check_plan(doc["compact_dry_run"])
    _check_writes(doc["writes"], store, permission)
    _check_cli(store, out, prefix, permission, READ_VERBS, WRITE_VERBS)


def _check_plan(plan: dict) -> None:
    """``compact(dry_run=True)``: every step planned, the index's compacted size measured (not skipped)."""
    assert plan["dry_run"] and plan["steps"][-1] == "index", plan
    before, after = plan["index"]
    assert 0 < after < before, plan  # a populated index always has free pages to give back


def _check_writes(writes: dict, store: Path, permission: str) -> None:
    for call, got in writes.items():
        assert got["raised"] == "StoreReadOnly" and got["kvshelf"], (call, got)
        assert str(store) in got["message"] and permission in got["message"], (call, got)
        assert f"{call} needs to write" in got["message"], (call, got)  # the call made, not a step inside it


def _check_cli(store: Path, out: Path, prefix: list[str], permission: str, read_verbs, write_verbs) -> None:
    for verb in read_verbs:
        proc = _run(prefix, ["-m", "kvshelf.tools.cli", *[a.format(out=out) for a in verb], "--store", str(store)])
        assert proc.returncode == 0, (verb, proc.stdout, proc.stderr)
    for verb, operation in write_verbs:
        proc = _run(prefix, ["-m", "kvshelf.tools.cli", *[a.format(out=out) for a in verb], "--store", str(store)])
        text = " ".join((proc.stdout + proc.stderr).split())  # import reports each file on stdout
        assert proc.returncode == 1 and "StoreReadOnly" in text, (verb, proc.stdout, proc.stderr)
        assert str(store) in text and permission in text and "Traceback" not in text, (verb, text)
        assert f"{operation} needs to write" in text, (verb, text)


def _shared_read_only(store: Path) -> None:
    """Everyone may read, only root (the owner) may write."""
    for base, dirs, files in os.walk(store):
        os.chmod(base, 0o755)
        for f in files:
            os.chmod(os.path.join(base, f), 0o644)


def _writable_out(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    os.chmod(out, 0o777)
    return out


def _check_as_nobody(store: Path, template: Path, tmp_path: Path) -> None:
    """Shared read-only (owner root), then every read and refused write as ``nobody``; no file or mode changes."""
    _shared_read_only(store)
    out = _writable_out(tmp_path)
    owner = _owner_view(template, tmp_path)
    before = _tree(store)
    _check(store, out, AS_NOBODY, "no write permission", owner)
    assert _tree(store) == before


def test_a_store_owned_by_root_opens_read_only_for_another_user(template, tmp_path) -> None:
    store = private_copy(template, tmp_path)
    _check_as_nobody(store, template, tmp_path)
    # and its owner still opens it for writing, as it is: nothing was chmod-ed back to 0700
    with open_store(store, identity=MODEL) as handle:
        assert not handle.read_only
    assert os.stat(store).st_mode & 0o777 == 0o755


@pytest.mark.host_feature("mount")
def test_a_store_on_a_read_only_mount_opens_read_only(template, tmp_path) -> None:
    source = private_copy(template, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    owner = _owner_view(template, tmp_path)
    mounted = subprocess.run(["mount", "--bind", str(source), str(mnt)], capture_output=True, text=True)
    assert mounted.returncode == 0, f"mount --bind failed (the test needs root with CAP_SYS_ADMIN): {mounted.stderr}"
    try:
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], capture_output=True, text=True)
        assert remount.returncode == 0, remount.stderr
        before = _tree(source)
        _check(mnt, out, [], "read-only file system", owner)
        assert _tree(source) == before
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_new_store_is_private_and_an_existing_one_keeps_its_modes(tmp_path) -> None:
    with open_store(tmp_path / "new", identity=MODEL):
        pass
    assert os.stat(tmp_path / "new").st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shutil.copytree(tmp_path / "new", shared)
    os.chmod(shared, 0o750)
    with open_store(shared, identity=MODEL) as store:
        assert not store.read_only
    assert os.stat(shared).st_mode & 0o777 == 0o750


def test_a_store_this_process_may_not_read_is_a_file_access_error_naming_it(template, tmp_path) -> None:
    """Root without its capabilities (``setpriv --bounding-set=-all``) on a store owned by nobody, 0700: neither a
    raw ``PermissionError`` nor "no store here", at the library and the CLI."""
    store = private_copy(template, tmp_path)
    for base, dirs, files in os.walk(store):
        os.chown(base, 65534, 65534)
        for f in files:
            os.chown(os.path.join(base, f), 65534, 65534)
    before = _tree(store)
    no_caps = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from tools_data import MODEL; from kvshelf import open_store\n"
            "try:\n    open_store(sys.argv[1], identity=MODEL)\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)")
    proc = _run(no_caps, ["-c", code, str(store), str(PROBE.parent)])
    assert proc.stdout.startswith("FileAccessError") and str(store) in proc.stdout, (proc.stdout, proc.stderr)
    assert "no read permission" in proc.stdout
    for verb in (["ls"], ["show", "s-mla"], ["verify"]):
        proc = _run(no_caps, ["-m", "kvshelf.tools.cli", *verb, "--store", str(store)])
        text = " ".join(proc.stderr.split())
        assert proc.returncode == 1 and "FileAccessError" in text and str(store) in text, (verb, text)
        assert "PermissionError" not in text and "no kvshelf store" not in text
    assert _tree(store) == before


@pytest.mark.parametrize("older", sorted(OLDER))
def test_a_store_of_an_older_index_format_is_read_as_it_is(tmp_path, older) -> None:
    """Format 1 (layout v1: chunk files, unsealed manifest files) and format 2 (prefix records tagged by snapshot):
    a writing open upgrades them in place, a read-only one cannot. Every read of the library and the CLI works on
    the file as it is — restores bit-exact, lookups through prefix records equal to what the upgrade would write,
    verify clean — and nothing in the store changes; the owner's next open still upgrades it."""
    import lmdb

    name, session = OLDER[older]
    store = tmp_path / "store"
    shutil.copytree(DATA / name, store, ignore=shutil.ignore_patterns("lock.mdb"))  # as committed: no tmp/ either
    _shared_read_only(store)
    out = _writable_out(tmp_path)
    before = _tree(store)
    want = json.loads((DATA / f"{name}.expected.json").read_text())
    proc = _run(AS_NOBODY, [str(PROBE), str(store), str(out), str(DATA / f"{name}.expected.json")])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["read_only"] is True and doc["sessions"] == sorted(want["sessions"])
    assert all(doc["restore"].values()), doc["restore"]
    for got, s in ((doc["lookup"][n], s) for n, s in want["sessions"].items()):
        assert got is not None and got[1] == len(s["tokens"]), (got, s["tokens"])
    assert doc["restore_prefix"] == {n: len(s["tokens"]) for n, s in want["sessions"].items()}
    assert doc["prefix_records_as_upgraded"] and doc["verify_deep"] == [] and doc["export"]
    assert doc["stats"] == len(want["sessions"]) and doc["gc_dry_run"]
    _check_plan(doc["compact_dry_run"])
    _check_writes(doc["writes"], store, "no write permission")
    read_verbs = [["ls"], ["show", session], ["stats"], ["verify", "--deep"], ["export", session, "{out}/cli.kvs"],
                  ["compact", "--dry-run"]]
    _check_cli(store, out, AS_NOBODY, "no write permission", read_verbs, [(["compact"], "compact")])
    assert _tree(store) == before
    with open_store(store, identity=Identity(*want["identity"]), chunk_tokens=want["chunk_tokens"]) as owner:
        assert not owner.read_only and owner.verify() == []
    env = lmdb.open(str(store / "index"), max_dbs=16, lock=False, readonly=True)
    with env.begin() as txn:
        assert txn.get(b"format", db=env.open_db(b"meta", txn=txn)) == INDEX_FORMAT.to_bytes(8, "little")
    env.close()


def test_a_format3_store_lacking_a_table_added_since_reads_read_only(template, tmp_path) -> None:
    """``pins`` and ``bad_chunks`` came after format 3 without a format change: a writing open creates them, a
    read-only one cannot (LMDB refuses to create a table in a read-only map) and reads them as empty."""
    import lmdb

    store = private_copy(template, tmp_path)
    env = lmdb.open(str(store / "index"), max_dbs=16)
    with env.begin(write=True) as txn:  # as a store written before those tables existed
        for name in (b"pins", b"bad_chunks"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
    env.close()
    _check_as_nobody(store, template, tmp_path)


def test_a_store_of_a_newer_index_format_is_refused_as_such_read_only(template, tmp_path) -> None:
    """Read-only, a format this kvshelf does not read is ``IncompatibleFormat`` (not ``StoreReadOnly``: no upgrade
    was going to be attempted), and nothing changes."""
    import lmdb

    store = private_copy(template, tmp_path)
    env = lmdb.open(str(store / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format", (INDEX_FORMAT + 1).to_bytes(8, "little"), db=env.open_db(b"meta", txn=txn))
    env.close()
    _shared_read_only(store)
    before = _tree(store)
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from tools_data import MODEL; from kvshelf import open_store\n"
            "try:\n    open_store(sys.argv[1], identity=MODEL)\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)")
    proc = _run(AS_NOBODY, ["-c", code, str(store), str(PROBE.parent)])
    assert proc.stdout.startswith("IncompatibleFormat") and f"format {INDEX_FORMAT + 1}" in proc.stdout, proc
    assert _tree(store) == before


def test_a_damaged_store_opened_read_only_is_reported_and_left_as_it_is(template, tmp_path) -> None:
    """A deep verify marks a failing copy bad on a writable handle; read-only it reports the damage (the CLI exits 1
    naming the session) and writes no mark, and ``repair --dry-run`` says what the owner's repair would do."""
    from store_cases import flip_chunk_byte

    store = private_copy(template, tmp_path)
    with open_store(store, identity=MODEL) as handle:
        flip_chunk_byte(handle, handle.admin.manifest(handle.restore("s-mla").snapshot_id).chunks[0].hash)
    _shared_read_only(store)
    before = _tree(store)
    proc = _run(AS_NOBODY, ["-m", "kvshelf.tools.cli", "verify", "--deep", "--json", "--store", str(store)])
    assert proc.returncode == 1, proc.stderr
    problems = json.loads(proc.stdout)["problems"]
    assert {(p["kind"], p["session_id"]) for p in problems} >= {("corrupt-chunk", "s-mla")}
    assert not any("marked bad" in p["detail"] for p in problems)
    proc = _run(AS_NOBODY, ["-m", "kvshelf.tools.cli", "repair", "--dry-run", "--json", "--store", str(store)])
    assert proc.returncode == 0 and "s-mla" in {r["session_id"] for r in json.loads(proc.stdout)["lost"]}, proc
    assert _tree(store) == before
