"""Smoke test of ``python -m benchmarks`` at its tiny size: one table, and a JSON file of the promised shape.

Speed is not checked (nothing in the benchmarks asserts an absolute time); structure is: every measure 1-11 has a
row, every row either carries real repetitions (min <= median, ratio = median / baseline median) or says which
optional dependency is absent, and never both; no row failed (the run exits 0 only then). A measure that raises
makes the run exit non-zero with a ``failed: <ExceptionType: message>`` row: proved by breaking
``kvshelf.store.open_store`` in the child process through a ``sitecustomize`` module, and an absent optional package
(mlx-lm hidden the same way) is a ``not available`` row that lets the run pass.
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
    proc, out = _bench(tmp, "--size", "small", "--reps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()), tmp


def _bench(tmp: Path, *args: str, sitecustomize: str | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m benchmarks *args`` in a child process; ``sitecustomize`` is the source of a module the child
    imports at start-up (Python's own hook), which is how a test breaks a dependency of every measure for real."""
    out = tmp / "latest.json"
    path = [str(REPO)]
    if sitecustomize is not None:
        hook = tmp / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(sitecustomize)
        path.insert(0, str(hook))
    env = dict(os.environ, KVSHELF_BENCH_SCRATCH=str(tmp / "scratch"), KVSHELF_BENCH_CACHE=str(tmp / "cache"),
               PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *args, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    return proc, out


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
    assert doc["args"] == {"only": [str(i) for i in range(1, 12)], "size": "small", "reps": 1}
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
    assert [r for r in rows if r["failed"]] == []
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


BREAK_OPEN_STORE = """
import kvshelf.store


def open_store(*args, **kwargs):
    raise RuntimeError("open_store broken by the test")


kvshelf.store.open_store = open_store
"""

DELETE_OPEN_STORE = """
import kvshelf.store

del kvshelf.store.open_store
"""

HIDE_MLX_LM = """
import sys


class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "mlx_lm" or name.startswith("mlx_lm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hide())
"""


def _rows(stdout: str, measure: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(f"| {measure} |")]


@pytest.mark.parametrize("hook, message", [
    (BREAK_OPEN_STORE, "failed: RuntimeError: open_store broken by the test"),
    # kvshelf is never an optional dependency: a name gone from it is a failure, not "not available"
    (DELETE_OPEN_STORE, "failed: ImportError: cannot import name 'open_store' from 'kvshelf.store'"),
], ids=["raises", "deleted"])
def test_a_measure_that_raises_fails_the_run_and_names_itself(tmp_path, hook, message):
    proc, out = _bench(tmp_path, "--size", "small", "--reps", "1", "--only", "8,11", sitecustomize=hook)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count(HEADER) == 1  # the table still prints
    for measure in ("8", "11"):
        rows = _rows(proc.stdout, measure)
        assert rows and all(message in r for r in rows), rows
        assert f"measure {measure} failed:" in proc.stderr
    doc = json.loads(out.read_text())
    assert {r["measure"] for r in doc["rows"] if r["failed"]} == {"8", "11"}
    assert all(r["unavailable"] is None and r["met"] is None for r in doc["rows"])


def test_an_absent_optional_package_is_not_available_and_the_run_passes(tmp_path):
    proc, out = _bench(tmp_path, "--size", "small", "--reps", "1", "--only", "8", sitecustomize=HIDE_MLX_LM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout, "8")
    assert rows and all("not available: mlx_lm is not installed" in r for r in rows), rows
    doc = json.loads(out.read_text())
    assert [r["unavailable"] for r in doc["rows"]] == ["mlx_lm is not installed"]
    assert not any(r["failed"] for r in doc["rows"])
