"""Timing, result rows, the one table and the JSON file every measure feeds.

Method (as in shared/reference/baseline.md): ``time.perf_counter`` around each operation, one untimed warm-up,
then ``reps`` timed repetitions with untimed setup/teardown around each; we keep every repetition and report min
and median. Ratios compare medians of the two sides measured in the same run. Targets are read from the ratios;
nothing here asserts an absolute time.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

MiB = 1 << 20

# Scratch space lives on /work's disk (ext4 on the VM's virtual disk), never on tmpfs: durable-write and
# page-cache figures only mean something on the filesystem the store will use.
SCRATCH_ROOT = Path(os.environ.get("KVSHELF_BENCH_SCRATCH", Path(__file__).resolve().parent / ".scratch"))


def _shown(path: Path) -> str:
    """A path as results files show it: relative to the repository when inside it (results are committed; where
    this checkout happens to live says nothing about the measurement)."""
    try:
        return str(Path(path).resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return str(path)


@dataclass
class Sample:
    """One timed (or counted) quantity: every repetition plus its min and median."""

    unit: str
    reps: list[float]

    @property
    def min(self) -> float:
        return min(self.reps)

    @property
    def median(self) -> float:
        return statistics.median(self.reps)

    def to_json(self) -> dict[str, Any]:
        return {"unit": self.unit, "reps": self.reps, "min": self.min, "median": self.median}


@dataclass
class Row:
    """One line of the table: a kvshelf figure beside its baseline, the ratio, the target and the verdict.

    ``value``/``baseline`` are ``Sample``s (or ``None``); ``ratio`` is value.median / baseline.median unless the
    measure sets it itself; ``target`` is a human string and ``limit`` the number the ratio (or, with
    ``check="value"``, the value's median) must not exceed. ``unavailable`` carries the reason a kvshelf piece
    could not be measured; such a row shows no number at all.
    """

    measure: str
    name: str
    value: Sample | None = None
    baseline: Sample | None = None
    baseline_name: str = ""
    target: str = ""
    limit: float | None = None
    check: str = "ratio"  # "ratio" | "value" | "ratio-min" (ratio must be at least limit) | "none"
    ratio: float | None = None
    unavailable: str | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ratio is None and self.value is not None and self.baseline is not None and self.baseline.median:
            self.ratio = self.value.median / self.baseline.median

    @property
    def met(self) -> bool | None:
        if self.unavailable or self.limit is None or self.check == "none":
            return None
        if self.check == "value":
            return self.value is not None and self.value.median <= self.limit
        if self.ratio is None:
            return None
        if self.check == "ratio-min":
            return self.ratio >= self.limit
        return self.ratio <= self.limit

    def to_json(self) -> dict[str, Any]:
        return {
            "measure": self.measure,
            "name": self.name,
            "value": self.value.to_json() if self.value else None,
            "baseline_name": self.baseline_name,
            "baseline": self.baseline.to_json() if self.baseline else None,
            "ratio": self.ratio,
            "target": self.target,
            "limit": self.limit,
            "check": self.check,
            "met": self.met,
            "unavailable": self.unavailable,
            "notes": self.notes,
            "extra": self.extra,
        }


def unavailable(measure: str, name: str, reason: str, *, baseline: Sample | None = None, baseline_name: str = "",
                target: str = "") -> Row:
    return Row(measure, name, baseline=baseline, baseline_name=baseline_name, target=target,
               unavailable=reason)


def time_reps(fn: Callable[[Any], Any], reps: int, *, warmup: int = 1, setup: Callable[[], Any] | None = None,
              teardown: Callable[[Any], None] | None = None, unit: str = "ms", collect: bool = True) -> Sample:
    """Time ``fn(setup())`` ``reps`` times after ``warmup`` untimed runs; setup and teardown are not timed.

    ``collect`` runs ``gc.collect()`` before each repetition (so one repetition's garbage is not collected inside
    the next); sub-millisecond operations pass False, as ``timeit`` does, because a full collection walks the whole
    heap and leaves the CPU caches cold for the call that follows."""
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    times: list[float] = []
    for i in range(warmup + reps):
        arg = setup() if setup is not None else None
        if collect:
            gc.collect()
        t0 = time.perf_counter()
        out = fn(arg)
        t1 = time.perf_counter()
        del out
        if teardown is not None:
            teardown(arg)
        if i >= warmup:
            times.append((t1 - t0) * scale)
    return Sample(unit, times)


class Scratch:
    """A private temporary directory on /work's disk, removed on exit."""

    def __init__(self, label: str) -> None:
        SCRATCH_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=SCRATCH_ROOT))
        self._n = 0

    def fresh(self, stem: str = "x") -> Path:
        """A new, not yet existing path inside the scratch directory."""
        self._n += 1
        return self.path / f"{stem}-{self._n}"

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_usage(root: Path, *, apparent: bool = False):
    """(allocated bytes from st_blocks, apparent bytes) of every regular file under ``root``; with
    ``apparent=True`` only the apparent bytes."""
    alloc = size = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            alloc += st.st_blocks * 512
            size += st.st_size
    return size if apparent else (alloc, size)


# ---------------------------------------------------------------------------------------------------------------
# Machine facts and versions


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def machine_info() -> dict[str, Any]:
    cpu = ""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_total = ""
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal"):
            mem_total = line.split(":", 1)[1].strip()
    SCRATCH_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    fs = ""
    try:
        best = ""
        for line in _read("/proc/mounts").splitlines():
            dev, mnt, kind, opts = line.split()[:4]
            if str(SCRATCH_ROOT).startswith(mnt) and len(mnt) >= len(best):
                best, fs = mnt, f"{kind} on {dev} at {mnt} ({opts})"
    except ValueError:
        pass
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_total": mem_total,
        "scratch": _shown(SCRATCH_ROOT),
        "scratch_fs": fs,
        "kernel": platform.release(),
    }
    try:
        import mlx.core as mx

        info["mlx_device"] = str(mx.default_device())
    except Exception as exc:  # noqa: BLE001 - report, never fail, on a broken MLX install
        info["mlx_device"] = f"unavailable: {exc}"
    return info


def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("kvshelf", "mlx", "mlx-cpu", "mlx-lm", "numpy", "safetensors", "lmdb", "zstandard", "msgspec",
                 "xxhash", "psutil"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ---------------------------------------------------------------------------------------------------------------
# Output


def _fmt_sample(s: Sample | None) -> str:
    if s is None:
        return "—"
    if s.unit in ("ms", "s", "us"):
        return f"{_num(s.min)} / {_num(s.median)} {s.unit}"
    return f"{_num(s.median)} {s.unit}" if s.min == s.median else f"{_num(s.min)} / {_num(s.median)} {s.unit}"


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def render_table(rows: list[Row]) -> str:
    """The one markdown table: figure (min / median), baseline, ratio of medians, target, verdict."""
    head = "| # | measure | kvshelf (min / med) | baseline | baseline (min / med) | ratio (med) | target | met |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.unavailable:
            value = f"not available: {r.unavailable}"
            ratio, met = "—", "—"
        else:
            value = _fmt_sample(r.value)
            ratio = f"{r.ratio:.3f}×" if r.ratio is not None else "—"
            met = {True: "met", False: "**not met**", None: "—"}[r.met]
        name = r.name + (f" ({r.notes})" if r.notes else "")
        lines.append(f"| {r.measure} | {name} | {value} | {r.baseline_name or '—'} | {_fmt_sample(r.baseline)} "
                     f"| {ratio} | {r.target or '—'} | {met} |")
    return "\n".join(lines)


def render_machine(machine: dict[str, Any], versions: dict[str, str]) -> str:
    parts = [(f"machine: {machine.get('cpu')} × {machine.get('cpus')} CPUs, {machine.get('mem_total')} RAM, "
              f"{machine.get('platform')}, MLX {machine.get('mlx_device')}"),
             f"scratch: {machine.get('scratch')} — {machine.get('scratch_fs')}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())]
    return "\n".join(parts)


def write_json(path: Path, *, args: dict[str, Any], machine: dict[str, Any], versions: dict[str, str],
               rows: list[Row], facts: dict[str, Any], elapsed_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": "kvshelf-bench-v1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": args,
        "machine": machine,
        "versions": versions,
        "facts": facts,
        "elapsed_s": elapsed_s,
        "rows": [r.to_json() for r in rows],
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


__all__ = [
    "MiB",
    "Row",
    "Sample",
    "Scratch",
    "asdict",
    "disk_usage",
    "fsync_path",
    "machine_info",
    "package_versions",
    "remove",
    "render_machine",
    "render_table",
    "time_reps",
    "unavailable",
    "write_json",
]
