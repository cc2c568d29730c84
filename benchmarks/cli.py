"""``python -m benchmarks``: run the measure groups, print one table, write ``results/latest.json``.

Exit status: 0 when every row was measured or names an absent optional dependency, 1 when any measure failed (its
rows say ``failed: <ExceptionType: message>``; the table still prints, so the other figures are not lost)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from . import data, stored
from .context import Context
from .harness import (
    Row,
    Scratch,
    machine_info,
    package_versions,
    render_machine,
    failure_row,
    render_table,
    write_json,
)

# measure group module -> the measure numbers it produces
GROUPS: dict[str, tuple[str, ...]] = {
    "save": ("1", "2", "3"),
    "restore": ("4", "5", "6", "11"),
    "kv": ("1", "2", "4", "5", "11"),
    "lookup": ("7",),
    "disk": ("8",),
    "compaction": ("9",),
    "memory": ("10",),
}
ALL = tuple(sorted({m for ms in GROUPS.values() for m in ms}, key=int))
# measure groups run only when asked for by number (--only): not part of the default run
OPTIONAL: dict[str, tuple[str, ...]] = {
    "decode": ("14",),
    "decode_planes": ("24",),  # compressed latents attended on their planes, against mlx-lm's KVCache
    "serve": ("31",),
    "serve_ops": ("32",),  # kvshelf serve: warm-up TTFT, /metrics + header overhead, bytes of a replay
    "resume": ("33",),  # generation checkpoints: a retried generation resumes
    "checkpoints": ("34",),  # hybrid models: reuse on a thinking-style replay, prefill cost, bytes per checkpoint
    "mlx_classes": ("35",),  # incremental saves of mlx-lm's own classes; bytes written per cached token
    "long_context": ("36",),  # kvshelf serve's restart TTFT at 8K-64K vs cold prefill; cold restore GB/s vs raw read
    "tenants": ("39",),  # tenant isolation in kvshelf serve: a salted RAM hit, the TTFT price of isolation
    "identity": ("38",),  # serve start-up: the weights' content fingerprint, sidecar warm vs cold (4 GiB)
    "encryption": ("37",),  # encryption at rest: save and warm restore with a key vs without
    "serve_memory": ("40",),  # kvshelf serve --prompt-cache-bytes: resident memory over distinct prompts vs plain
    "agents": ("41",),  # a 20-turn agent trace: prefilled tokens and TTFT, kvshelf serve vs mlx_lm.server
    "batched_resume": ("42",),  # a burst of 8 greedy requests with generation checkpoints vs plain mlx_lm.server
    "remote": ("21", "22", "23"),  # the shared tier: needs redis-server / redis-benchmark
}
KNOWN = tuple(sorted({*ALL, *(m for ms in OPTIONAL.values() for m in ms)}, key=int))
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--only", default=",".join(ALL),
                   help="comma-separated measure numbers (default: all 1-11; on request: 14, the decode step, 24, decode on "
                        "encoded latent planes, 21-23, the shared tier on a redis-server, 31, kvshelf serve's time to "
                        "first token, 32, its warm-up, instrumentation overhead and replayed-conversation writes, 33, a "
                        "retried generation resuming from its checkpoint, 34, state checkpoints on a hybrid model, 35-36, "
                        "incremental saves of mlx-lm classes and long-context restarts, 37, encryption at rest, 38, the "
                        "model identity of 4 GiB of weights, 39, tenant isolation, 40, kvshelf serve's resident memory, "
                        "41, a 20-turn agent trace, 42, a burst of checkpointed greedy requests)")
    p.add_argument("--size", choices=sorted(data.SIZES), default="L",
                   help="workload: L (4096 tokens, 176 MiB; default), L-large (16,384 tokens, 704 MiB) or small "
                        "(a tiny smoke-test size)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per figure after one warm-up (default 3)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results path (default {DEFAULT_OUT})")
    p.add_argument("--markdown", type=Path, default=None,
                   help="also write the machine facts and the table to this markdown file")
    p.add_argument("--store", action="store_true",
                   help="write the table and the JSON to benchmarks/results/<date>-<commit>[-<label>].md/.json (the "
                        "files the README and docs quote); refused while kvshelf/ or benchmarks/ differ from the "
                        "commit")
    p.add_argument("--label", default=None, help="suffix of a stored run's file name (e.g. the measures it holds)")
    args = p.parse_args(argv)
    only = {m.strip() for m in args.only.split(",") if m.strip()}
    bad = only - set(KNOWN)
    if bad:
        p.error(f"--only: unknown measure(s) {sorted(bad)}; choose from {', '.join(KNOWN)}")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    args.only = only
    args.commit = None
    if args.store:
        commit, changed = stored.measured_commit()
        if changed:
            p.error("--store: the measured code differs from the commit it would be named by; commit it first:\n  "
                    + "\n  ".join(changed))
        try:
            args.markdown, args.out = stored.stored_paths(commit, args.label)
        except ValueError as exc:
            p.error(str(exc))
        args.commit = commit
    elif args.label is not None:
        p.error("--label names a stored run: use it with --store")
    return args


def run(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    workload, large = data.SIZES[args.size]
    machine, versions = machine_info(), package_versions()
    print(render_machine(machine, versions), flush=True)
    print(f"workload {workload.describe()}; large {large.describe()}; reps {args.reps} (+1 warm-up)", flush=True)
    rows: list[Row] = []
    with Scratch("run") as scratch:
        ctx = Context(workload, large, args.reps, scratch)
        ctx.facts.update({"workload": workload.describe(), "large": large.describe()})
        for group, measures in {**GROUPS, **OPTIONAL}.items():
            wanted = set(measures) & args.only
            if not wanted:
                continue
            t0 = time.perf_counter()
            print(f"… measures {', '.join(sorted(wanted, key=int))} ({group})", flush=True)
            try:
                module = importlib.import_module(f"benchmarks.{group}")
                rows += module.run(ctx, wanted)
            except Exception as exc:  # noqa: BLE001 - one failing group must not hide the others' figures
                rows += [failure_row(m, f"measure {m} ({group})", exc, traceback=i == 0)
                         for i, m in enumerate(sorted(wanted, key=int))]
            ctx.facts[f"{group}_elapsed_s"] = round(time.perf_counter() - t0, 2)
        ctx.drop()
    rows.sort(key=lambda r: int(r.measure))
    elapsed = time.perf_counter() - started
    table = render_table(rows)
    footer = (f"(times: min / median of {args.reps} after a warm-up of each side, the sides interleaved; ratio = "
              f"kvshelf median ÷ baseline median; {elapsed:.0f} s in all)")
    print()
    print(table)
    print("\n" + footer)
    if args.markdown is not None:
        cmd = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
        of = f" — code at commit {args.commit}" if args.commit else ""
        args.markdown.write_text(f"`{cmd.strip()}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{of}\n\n"
                                 f"```\n{render_machine(machine, versions)}\n```\n\n{table}\n\n{footer}\n")
    write_json(args.out, args={"only": sorted(args.only, key=int), "size": args.size, "reps": args.reps,
                               **({"commit": args.commit} if args.commit else {})},
               machine=machine, versions=versions, rows=rows, facts=ctx.facts, elapsed_s=elapsed)
    print(f"wrote {args.out}")
    return {"rows": rows, "out": args.out}


def main(argv: list[str] | None = None) -> int:
    """1 when any row failed (named on stderr), else 0: a failure must not pass as a table with a gap in it."""
    rows = run(argv)["rows"]
    broken = [r for r in rows if r.failed]
    for r in broken:
        print(f"measure {r.measure} failed: {r.name}: {r.failed}", file=sys.stderr)
    return 1 if broken else 0
