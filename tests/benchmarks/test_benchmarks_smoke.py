"""Smoke test of ``python -m benchmarks`` at its tiny size: one table, and a JSON file of the promised shape.

Speed is not checked (nothing in the benchmarks asserts an absolute time); structure is: every measure 1-11 has a
row, every row either carries real repetitions (min <= median, ratio = median / baseline median) or says why it is
not available, and never both.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEADER = "| # | measure | kvshelf (min / med) | baseline | baseline (min / med) | ratio (med) | target | met |"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "latest.json"
    env = dict(os.environ, KVSHELF_BENCH_SCRATCH=str(tmp / "scratch"), KVSHELF_BENCH_CACHE=str(tmp / "cache"),
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--size", "small", "--reps", "2", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()), tmp


def _check_sample(sample: dict, reps: int | None) -> None:
    assert set(sample) == {"unit", "reps", "min", "median"}
    assert sample["reps"], sample
    if reps is not None and sample["unit"] in ("ms", "s", "us"):
        assert len(sample["reps"]) >= min(reps, 2)
    assert sample["min"] == min(sample["reps"])
    assert sample["median"] == statistics.median(sample["reps"])


def test_prints_one_table_and_machine_facts(run):
    stdout, _, _ = run
    assert stdout.count(HEADER) == 1
    assert stdout.startswith("machine: ")
    assert "wrote " in stdout


def test_json_top_level(run):
    _, doc, _ = run
    assert doc["schema"] == "kvshelf-bench-v1"
    assert doc["args"] == {"only": [str(i) for i in range(1, 12)], "size": "small", "reps": 2}
    for key in ("platform", "python", "cpus", "scratch_fs", "mlx_device"):
        assert key in doc["machine"], key
    assert doc["versions"]["mlx"] != "not installed"
    assert doc["versions"]["mlx-lm"] != "not installed"
    assert doc["elapsed_s"] > 0


def test_every_measure_has_a_row_with_real_numbers_or_a_reason(run):
    _, doc, _ = run
    rows = doc["rows"]
    assert {r["measure"] for r in rows} == {str(i) for i in range(1, 12)}
    assert [int(r["measure"]) for r in rows] == sorted(int(r["measure"]) for r in rows)
    for r in rows:
        if r["unavailable"]:
            assert r["value"] is None and r["ratio"] is None and r["met"] is None, r
            continue
        _check_sample(r["value"], doc["args"]["reps"])
        if r["baseline"] is not None:
            _check_sample(r["baseline"], doc["args"]["reps"])
        if r["check"] in ("ratio", "ratio-min") and r["ratio"] is not None and r["measure"] != "9":
            assert r["ratio"] == pytest.approx(r["value"]["median"] / r["baseline"]["median"])
        if r["limit"] is not None and r["check"] == "ratio":
            assert r["met"] == (r["ratio"] <= r["limit"])
        if r["check"] == "value":
            assert r["met"] == (r["value"]["median"] <= r["limit"])


def test_baselines_are_measured_even_without_kvshelf_pieces(run):
    _, doc, _ = run
    by = {}
    for r in doc["rows"]:
        by.setdefault(r["measure"], []).append(r)
    # mlx-lm and raw baselines exist independently of the store: they must always carry numbers.
    for m in ("1", "2", "4", "7", "8", "10"):
        assert any(r["baseline"] and r["baseline"]["reps"] for r in by[m]), m
    # compaction of structured bf16 data carries the target and really compresses.
    bf16 = [r for r in by["9"] if r["limit"] == 1.35]
    assert len(bf16) == 1 and "bfloat16" in bf16[0]["name"] and "structured" in bf16[0]["name"]
    assert bf16[0]["ratio"] > 1.0 and bf16[0]["check"] == "ratio-min"
    noise = [r for r in by["9"] if "i.i.d." in r["name"]]
    assert len(noise) == 3


def test_scratch_is_removed(run):
    _, _, tmp = run
    scratch = tmp / "scratch"
    assert not scratch.exists() or list(scratch.iterdir()) == []
