"""Timing, result rows, the one table and the JSON file every measure feeds.

Method (as in shared/reference/baseline.md): ``time.perf_counter`` around each operation, one untimed warm-up of
each side, then ``reps`` timed repetitions of kvshelf and its baseline interleaved (A B A B …, ``time_interleaved``)
with untimed setup/teardown around each, so a noisy neighbour or a page-cache change hits both sides alike; we keep
every repetition and report min and median. Ratios compare medians of the two sides measured in the same run.
Targets are read from the ratios; nothing here asserts an absolute time.

A measure that raises is a ``failed`` row and makes the run exit non-zero (``failure_row``): only an absent
optional dependency (a package named in ``OPTIONAL_PACKAGES`` that does not import, or a server binary not on the
PATH, raised as ``MissingDependency``) is a ``not available`` row, because that says something about the machine
rather than about kvshelf.
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
import traceback as _traceback
from collections.abc import Callable, Mapping
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
    failed: str | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ratio is None and self.value is not None and self.baseline is not None and self.baseline.median:
            self.ratio = self.value.median / self.baseline.median

    @property
    def met(self) -> bool | None:
        if self.unavailable or self.failed or self.limit is None or self.check == "none":
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
            "failed": self.failed,
            "notes": self.notes,
            "extra": self.extra,
        }


# Packages the benchmarks may run without (the row then says which one is absent); kvshelf itself, MLX and numpy
# are never optional: a measure that cannot import them has failed.
OPTIONAL_PACKAGES = frozenset({"mlx_lm", "psutil", "redis", "hiredis", "prometheus_client", "transformers", "openai"})


class MissingDependency(Exception):
    """An optional dependency is absent (a package, or a server binary such as ``redis-server``): the measure's
    rows say ``not available: <what>`` and the run may still exit 0."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def absent_dependency(exc: BaseException) -> str | None:
    """The optional dependency whose absence ``exc`` reports, or None when ``exc`` is a real failure.

    Only a module that is not installed counts (``ModuleNotFoundError`` naming an optional package): a name missing
    from a module that does import (``ImportError: cannot import name``) is a broken or mismatched install, and an
    import error inside kvshelf is kvshelf's failure."""
    if isinstance(exc, MissingDependency):
        return exc.what
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] in OPTIONAL_PACKAGES:
        return f"{exc.name.split('.')[0]} is not installed"
    return None


def unavailable(measure: str, name: str, reason: str, *, baseline: Sample | None = None, baseline_name: str = "",
                target: str = "") -> Row:
    """A row for an absent optional dependency (``reason`` names it)."""
    return Row(measure, name, baseline=baseline, baseline_name=baseline_name, target=target,
               unavailable=reason)


def failed(measure: str, name: str, reason: str, *, target: str = "") -> Row:
    """A row for a measure that could not produce a true figure (a wrong answer, an exception): the run fails."""
    return Row(measure, name, target=target, failed=reason)


def failure_row(measure: str, name: str, exc: BaseException, *, baseline: Sample | None = None,
                baseline_name: str = "", target: str = "", traceback: bool = True) -> Row:
    """The row for an exception a measure raised: ``not available`` for an absent optional dependency, else
    ``failed`` (with the traceback on stderr unless ``traceback=False``, since the row holds one line)."""
    what = absent_dependency(exc)
    if what is not None:
        return unavailable(measure, name, what, baseline=baseline, baseline_name=baseline_name, target=target)
    if traceback:
        _traceback.print_exception(exc, file=sys.stderr)
    return failed(measure, name, f"{type(exc).__name__}: {exc}", target=target)


def guarded(measure: str, name: str, fn: Callable[..., list[Row]], *args: Any) -> list[Row]:
    """``fn(*args)``'s rows, or the one row saying why it raised: measures of one module fail apart."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported as a failed row; cli exits non-zero on it
        return [failure_row(measure, name, exc)]


@dataclass
class Timed:
    """One side of a comparison: ``fn(setup())`` is timed; ``setup`` and ``teardown(arg)`` are not."""

    fn: Callable[[Any], Any]
    setup: Callable[[], Any] | None = None
    teardown: Callable[[Any], None] | None = None


_SCALE = {"ms": 1e3, "s": 1.0, "us": 1e6}


def _once(case: Timed, collect: bool) -> float:
    arg = case.setup() if case.setup is not None else None
    if collect:
        gc.collect()
    t0 = time.perf_counter()
    out = case.fn(arg)
    t1 = time.perf_counter()
    del out
    if case.teardown is not None:
        case.teardown(arg)
    return t1 - t0


def time_interleaved(cases: Mapping[str, Timed | Callable[[Any], Any]], reps: int, *, warmup: int = 1,
                     unit: str = "ms", collect: bool = True) -> dict[str, Sample]:
    """Time every case ``reps`` times, interleaved: ``warmup`` untimed runs of each case, then rounds of one
    repetition of each case in turn (A B A B …). Drift on the machine (another process, the page cache, thermal
    state) then lands on every side alike instead of on whichever block ran during it.

    ``collect`` runs ``gc.collect()`` before each repetition (so one repetition's garbage is not collected inside
    the next); sub-millisecond operations pass False, as ``timeit`` does, because a full collection walks the whole
    heap and leaves the CPU caches cold for the call that follows."""
    scale = _SCALE[unit]
    timed = {k: c if isinstance(c, Timed) else Timed(c) for k, c in cases.items()}
    for case in timed.values():
        for _ in range(warmup):
            _once(case, collect)
    times: dict[str, list[float]] = {k: [] for k in timed}
    for _ in range(reps):
        for key, case in timed.items():
            times[key].append(_once(case, collect) * scale)
    return {k: Sample(unit, v) for k, v in times.items()}


def time_reps(fn: Callable[[Any], Any], reps: int, *, warmup: int = 1, setup: Callable[[], Any] | None = None,
              teardown: Callable[[Any], None] | None = None, unit: str = "ms", collect: bool = True) -> Sample:
    """One side alone (an operation with no baseline to interleave with): ``time_interleaved`` of one case."""
    return time_interleaved({"": Timed(fn, setup, teardown)}, reps, warmup=warmup, unit=unit, collect=collect)[""]


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
        if r.failed:
            value = f"failed: {r.failed}".replace("|", "/").replace("\n", " ")
            ratio, met = "—", "—"
        elif r.unavailable:
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
    "OPTIONAL_PACKAGES",
    "MiB",
    "MissingDependency",
    "Row",
    "Sample",
    "Scratch",
    "Timed",
    "absent_dependency",
    "asdict",
    "disk_usage",
    "failed",
    "failure_row",
    "fsync_path",
    "guarded",
    "machine_info",
    "package_versions",
    "remove",
    "render_machine",
    "render_table",
    "time_interleaved",
    "time_reps",
    "unavailable",
    "write_json",
]
