"""Structure of measures 35 (incremental saves of mlx-lm's classes, bytes per cached token) and 36 (restart TTFT at
long context) at the tiny size, run as users run them (``python -m benchmarks --only 35,36``), and that they run on
request only.

Nothing here checks a speed: every timed row carries its repetitions beside a baseline from the same run, 35's
counted work shows the grown session wrote only its new window, and 36's restart request was served from disk (the
measure fails its row otherwise, and the run then exits 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import cli

ROOT = Path(__file__).resolve().parents[2]


def test_measures_35_and_36_run_on_request_only():
    for m in ("35", "36"):
        assert m not in cli.ALL and m in cli.KNOWN
        assert m not in cli.parse_args([]).only


def test_measures_35_and_36_at_the_small_size(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "35,36", "--size", "small", "--reps", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env={**__import__("os").environ, "KVSHELF_BENCH_SCRATCH": str(tmp_path / "scratch")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by = {}
    for r in rows:
        by.setdefault(r["measure"], []).append(r)
    incremental = [r for r in by["35"] if r["name"].startswith("incremental save")]
    assert len(incremental) == 3 and all(not r.get("failed") for r in by["35"])
    kv = next(r for r in incremental if "KVCache f16" in r["name"])
    work = kv["extra"]["work"][-1]
    # 2 layers × keys and values × 2 heads × 256 new tokens × 64 dims × float16: the new window only, the stored
    # 512 tokens verified
    assert work["bytes_written"] == 2 * 2 * 2 * 256 * 64 * 2
    assert work["bytes_verified"] == 2 * 2 * 2 * 512 * 64 * 2
    # an unwrapped RotatingKVCache is stored as rows: the same work as KVCache's
    rotating = next(r for r in incremental if "RotatingKVCache" in r["name"])
    assert rotating["extra"]["work"][-1] == work
    per_token = [r for r in by["35"] if r["name"].startswith("bytes written per cached token")]
    assert len(per_token) == 3 and all(r["ratio"] >= 1.0 for r in per_token)
    # each save cuts where the last one did: every turn's rows are written once, whatever the turn's length
    assert all(r["extra"]["bytes_written"] == r["extra"]["kv_bytes"] for r in per_token)
    assert len(by["36"]) == 2 and all(not r.get("failed") for r in by["36"])
    assert by["36"][0]["value"]["reps"] and by["36"][0]["baseline"]["reps"]


def test_measure_36_synthesized_session_is_restored_by_the_restarted_server(tmp_path):
    """A length above ``KVSHELF_BENCH_LONG_PREFILL`` is stored without a prefill (the serve's identity, namespace,
    session id and token ids): the restarted server must find it on disk (the row fails otherwise), and the row
    says the KV was synthesized and that no cold prefill was measured."""
    out = tmp_path / "run.json"
    env = {**__import__("os").environ, "KVSHELF_BENCH_SCRATCH": str(tmp_path / "scratch"),
           "KVSHELF_BENCH_LONG_PREFILL": "0"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "36", "--size", "small", "--reps", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and not any(r.get("failed") for r in rows)
    row = rows[0]
    assert "KV synthesized" in row["name"] and row["baseline"] is None
    assert "NOT measured" in row["baseline_name"]
    assert row["extra"]["kv_synthesized"] is True and row["extra"]["prompt_kv_bytes"] > 0
    assert row["extra"]["server_peak_growth_over_kv"] is not None
