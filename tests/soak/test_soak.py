"""The short soak CI runs (issue 12): >= 50 kill -9 trials, >= 2,000 single-byte flips, 4 processes of mixed traffic,
ENOSPC. ``python -m tests.soak`` runs it in a subprocess (any store layout: public API and raw file operations only).

Two verdicts on one run. Outside the index layer (kills, chunk and blob-header bytes, portable files, concurrency,
a full disk) nothing may be wrong, crashed or lost; and across the whole table nothing is wrong, crashed or lost and
no raw error escapes — index records and tokens sealed, pack trailers checksummed, a damaged ``data.mdb`` refused at
open by its meta pages and a walk of every live page (store v2 + issue 12).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KILLS, FLIPS, SECONDS, HEALS = 50, 2000, 5, 24
INDEX_ROWS = ("LMDB data.mdb", "manifest files")  # what store v2's checksummed records and open-time check own


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "tests.soak", "--kills", str(KILLS), "--flips", str(FLIPS),
                           "--seconds", str(SECONDS), "--heals", str(HEALS), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200, check=False)
    print(proc.stdout[-6000:])
    assert out.exists(), proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    doc["rc"], doc["stdout"] = proc.returncode, proc.stdout
    return doc


def failures(rows: dict) -> dict[str, int]:
    return {row: c["wrong"] + c["crashes"] + c["lost"] for row, c in rows.items() if c["wrong"] + c["crashes"] + c["lost"]}


@pytest.mark.slow
def test_short_soak_is_clean_outside_the_index_layer(soak) -> None:
    rows = soak["rows"]
    kills = sum(c["trials"] for row, c in rows.items() if row.startswith("kill"))
    flips = sum(c["trials"] for row, c in rows.items() if row.startswith("flip"))
    assert kills >= KILLS and flips >= FLIPS, rows
    assert rows["mixed traffic, 4 processes"]["trials"] > 0 and rows["mixed traffic, 4 processes"]["exact"] > 0
    assert sum(c["exact"] for row, c in rows.items() if row.startswith("kill")) == kills  # kill -9 loses nothing
    assert rows["flip: chunk bytes"]["detected"] == rows["flip: chunk bytes"]["trials"]  # every chunk flip caught
    heal = rows["heal: damage, detect, save, repair"]  # every damaged chunk detected, then healed or reported
    assert heal["trials"] >= 20 and heal["detected"] == heal["trials"], heal
    outside = {row: n for row, n in failures(rows).items() if not any(k in row for k in INDEX_ROWS)}
    assert outside == {}, (outside, soak["notes"])


LMDB_FLIPS = "flip: LMDB data.mdb"


@pytest.mark.slow
def test_short_soak_is_clean(soak) -> None:
    """Nothing wrong, crashed or lost anywhere, no raw error anywhere — a damaged ``data.mdb`` included: the page
    walk before LMDB maps it (``lmdbcheck``/``lmdbpages``) refuses what would kill the process inside liblmdb."""
    assert failures(soak["rows"]) == {}, (failures(soak["rows"]), soak["notes"])
    assert soak["rows"][LMDB_FLIPS]["detected"] > 0  # flips landing in live pages are caught at open
    assert soak["rc"] == 0


E_KILLS, E_FLIPS, E_HEALS = 20, 600, 8


@pytest.fixture(scope="module")
def soak_encrypted(tmp_path_factory) -> dict:
    """The same trials on stores encrypted at rest (``--encrypted``: every process opens with the same key)."""
    out = tmp_path_factory.mktemp("soak-enc") / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "tests.soak", "--encrypted", "--kills", str(E_KILLS), "--flips",
                           str(E_FLIPS), "--seconds", "3", "--heals", str(E_HEALS), "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200, check=False)
    print(proc.stdout[-6000:])
    assert out.exists(), proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    doc["rc"] = proc.returncode
    return doc


@pytest.mark.slow
def test_short_soak_on_an_encrypted_store_is_clean(soak_encrypted) -> None:
    """Kills, flips (sealed chunks, their headers, ``keys/``), heals and mixed traffic against sealed chunks: nothing
    wrong, crashed or lost; every flipped chunk byte caught (by its GCM tag) and every kill -9 loses nothing."""
    rows = soak_encrypted["rows"]
    assert failures(rows) == {}, (failures(rows), soak_encrypted["notes"])
    kills = sum(c["trials"] for row, c in rows.items() if row.startswith("kill"))
    assert kills >= E_KILLS and sum(c["exact"] for row, c in rows.items() if row.startswith("kill")) == kills
    assert rows["flip: chunk bytes"]["trials"] > 0
    assert rows["flip: chunk bytes"]["detected"] == rows["flip: chunk bytes"]["trials"]
    assert rows["mixed traffic, 4 processes"]["exact"] > 0
    assert soak_encrypted["rc"] == 0
