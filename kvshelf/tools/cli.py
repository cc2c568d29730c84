"""The ``kvshelf`` command line: argparse parses (:mod:`kvshelf.tools.cli_args`), :mod:`kvshelf.tools.render` prints,
library functions do the work; this module holds the command bodies and ``main``.

Exit codes: 0 all is well, 1 problems found (corruption, orphans, a failed import, an error from the store),
2 usage error (argparse's own exit code).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..errors import KvShelfError, file_error
from .paths import KEY_FILE_VAR
from .cli_args import _expect, _store_dir, build_parser
from .render import Printer, human_bytes, human_time, kv_table, rows_table, to_data

OK, PROBLEMS, USAGE = 0, 1, 2
WIDE = 160  # console width from which `kvshelf ls` shows every column

# --- commands --------------------------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace, pr: Printer) -> int:
    from .demo import run_demo

    lines: list[str] = []
    out = lines.append if args.json else (lambda text: pr.out.print(text))
    result = run_demo(store_dir=_store_dir(args), out=out)
    if args.json:
        pr.emit(result, lambda _c: None)
    return OK


def cmd_ls(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    if args.remote:
        return _remote_ls(args, pr)
    with admin.open_admin(_store_dir(args)) as store:
        rows = admin.of_tenant(admin.list_sessions(store, **_expect(args)), args.tenant)

    if args.ids:  # bare session ids, one a line, each once: what `kvshelf pin ID` takes (scripts, copy and paste)
        seen = dict.fromkeys(r["session_id"] for r in rows)
        sys.stdout.write("".join(f"{sid}\n" for sid in seen))
        return OK

    def human(console) -> None:
        full = {
            "namespace": lambda r: r["namespace"] or "\"\"", "session": lambda r: r["session_id"],
            "model": lambda r: r["model_id"], "tokens": lambda r: r["tokens"],
            "own": lambda r: human_bytes(r["bytes_own"]), "shared": lambda r: human_bytes(r["bytes_shared"]),
            "created": lambda r: human_time(r["created_at"]), "last used": lambda r: human_time(r["last_used_at"]),
            "floor": lambda r: r["minimum_reusable_offset"], "kinds": lambda r: ",".join(r["kinds"]),
            "formats": lambda r: ",".join(r["formats"]), "pinned": _pin_text,
            "checkpoints": lambda r: ",".join(str(k) for k in r.get("checkpoints", [])),
        }
        # a narrow console (a pipe: $COLUMNS, else 80) gets the columns an operator acts on; --json has them all
        columns = list(full) if console.width >= WIDE else ["session", "namespace", "tokens", "own", "last used",
                                                             "pinned"]
        table_rows = [tuple(full[c](r) for c in columns) for r in rows]
        console.print(rows_table(f"{len(rows)} session(s)", columns, table_rows, whole=("session",)))
        if columns != list(full):
            console.print(f"(columns for {console.width} characters; COLUMNS={WIDE} or wider shows model, kinds, "
                          f"formats, sizes and checkpoints; --json shows everything)")

    pr.emit({"sessions": rows}, human)
    return OK


def _pin_text(row: dict) -> str:
    if not row.get("pinned"):
        return ""
    return "yes" if row.get("pin_expires_at") is None else f"until {human_time(row['pin_expires_at'])}"


def cmd_show(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    with admin.open_admin(_store_dir(args)) as store:
        doc = admin.show(store, args.target, **_expect(args))

    def human(console) -> None:
        head = [(k, doc[k]) for k in ("snapshot_id", "session_id", "namespace", "model_id", "config_fingerprint",
                                      "tokenizer_hash", "provider", "tokens") if k in doc]
        head.append(("created", human_time(doc.get("created_at"))))
        console.print(kv_table("snapshot", head))
        layer_rows = []
        for i, e in enumerate(doc["caches"]):
            pages = e.get("pages")
            table = "-" if not pages else f"bs={pages['block_size']} n={pages['num_blocks']} {pages['block_table']}"
            fmt = admin.format_of(e)
            geometry = f"{e.get('kv_lora_rank')}+{e.get('rope_head_dim')}" + (
                f"+{e['index_head_dim']}" if e.get("index_head_dim") else "")
            layer_rows.append((i, e["kind"], e["offset"], e["minimum_reusable_offset"], geometry, fmt,
                               "yes" if e.get("shadow") else "no", table, len(e.get("tensors", []))))
        console.print(rows_table("caches", ("layer", "kind", "offset", "floor", "geometry", "format", "shadow",
                                            "pages", "tensors"), layer_rows, whole=("kind", "format")))
        chunk_rows = [(c.get("hash"), c.get("start"), c.get("stop"), human_bytes(c.get("nbytes")),
                       human_bytes(c.get("stored_bytes")), c.get("encoding"), c.get("refs"))
                      for c in doc.get("chunks", [])]
        console.print(rows_table("chunks", ("hash", "start", "stop", "bytes", "on disk", "encoding", "refs"),
                                 chunk_rows, whole=("hash",)))
        if doc.get("checkpoints"):  # the session's checkpoints (docs/CHECKPOINTS.md)
            console.print(rows_table("checkpoints", ("tokens", "snapshot", "bytes"),
                                     [(c["tokens"], c["snapshot_id"], human_bytes(c["nbytes"]))
                                      for c in doc["checkpoints"]], whole=("snapshot",)))

    pr.emit(doc, human)
    return OK


def _remote_ls(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    wanted = {k: v for k, v in _expect(args).items() if k in ("model_id", "namespace")}
    rows = [r for r in admin.remote_sessions(args.remote, args.remote_prefix)
            if all(r.get(k) == v for k, v in wanted.items())]
    rows = rows if args.tenant is None else admin.of_tenant(rows, args.tenant)

    def human(console) -> None:
        table_rows = [(r.get("namespace", "?") or "\"\"", r.get("session_id", "?"), r.get("model_id", "?"),
                       r.get("tokens", "?"), human_bytes(r.get("bytes")), r.get("chunks", "?"),
                       human_time(r.get("created_at")), r.get("host", ""), r.get("broken", ""))
                      for r in rows]
        console.print(rows_table(f"{len(rows)} remote entr{'y' if len(rows) == 1 else 'ies'}",
                                 ("namespace", "session", "model", "tokens", "bytes", "chunks", "created", "host",
                                  "broken"), table_rows, whole=("session",)))

    pr.emit({"remote": rows}, human)
    return PROBLEMS if any("broken" in r for r in rows) else OK


def cmd_stats(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    if args.remote:
        doc = admin.remote_stats(args.remote, args.remote_prefix)
        pr.emit(doc, lambda console: console.print(kv_table("remote tier", [
            (k, human_bytes(v) if k.endswith(("bytes", "memory")) and isinstance(v, int) else v)
            for k, v in doc.items()])))
        return PROBLEMS if doc["broken_entries"] else OK
    with admin.open_admin(_store_dir(args)) as store:
        doc = admin.stats(store, max_bytes=args.max_bytes)
        doc["tenants"] = admin.tenant_totals(store)

    def human(console) -> None:
        console.print(kv_table("store", [(k, human_bytes(v) if k.endswith("bytes") else v) for k, v in doc.items()
                                         if k != "tenants"]))
        console.print(rows_table("tenants", ("tenant", "sessions", "checkpoints", "bytes"),
                                 [(t or "(default)", r["sessions"], r["checkpoints"], human_bytes(r["bytes"]))
                                  for t, r in doc["tenants"].items()]))

    pr.emit(doc, human)
    return PROBLEMS if doc.get("orphan_count") else OK


def cmd_verify(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    with admin.open_admin(_store_dir(args)) as store, pr.progress("verifying", None) as advance:
        doc = admin.verify(store, deep=args.deep, progress=advance)

    def human(console) -> None:
        console.print(f"checked {doc['snapshots']} snapshot(s), {doc['chunks']} chunk(s)"
                      f"{' (deep: re-hashed)' if doc['deep'] else ''}")
        handled = [p for p in doc["problems"] if not p["needs_operator"]]
        needs = [p for p in doc["problems"] if p["needs_operator"]]
        if handled:
            console.print(rows_table(f"{len(handled)} finding(s) already handled, nothing lost (`kvshelf gc` / "
                                     f"`kvshelf repair` reclaim what they left)", ("session", "snapshot", "what"),
                                     [(p.get("session_id"), p.get("snapshot_id"), p.get("message"))
                                      for p in handled], whole=("snapshot",)))
        if needs:
            console.print(rows_table(f"{len(needs)} problem(s) need an operator (`kvshelf repair`)",
                                     ("session", "snapshot", "what"),
                                     [(p.get("session_id"), p.get("snapshot_id"), p.get("message"))
                                      for p in needs], whole=("snapshot",)))
        if not doc["problems"]:
            console.print("no problems found")

    pr.emit(doc, human)
    return PROBLEMS if doc["needs_operator"] else OK


def cmd_gc(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    if args.incompatible:
        return _gc_incompatible(args, pr)
    if args.remote:
        doc = admin.remote_gc(args.remote, args.remote_prefix, dry_run=args.dry_run)

        def remote_human(console) -> None:
            if doc["skipped"]:
                console.print(f"remote gc skipped: {doc['skipped']}")
                return
            verb = "would remove" if args.dry_run else "removed"
            console.print(f"{verb} {doc['chunks']} remote chunk(s), {human_bytes(doc['bytes'])}; "
                          f"{doc['entries_dropped']} unservable entr(ies), {doc['boundary_records']} stale record(s)")

        pr.emit(doc, remote_human)
        return PROBLEMS if doc["skipped"] else OK
    with admin.open_admin(_store_dir(args)) as store:
        doc = admin.gc(store, dry_run=args.dry_run)

    def human(console) -> None:
        verb = "would remove" if args.dry_run else "removed"
        console.print(f"{verb} {doc['objects']} object(s), {human_bytes(doc['bytes'])}")

    pr.emit(doc, human)
    return OK


def _gc_incompatible(args: argparse.Namespace, pr: Printer) -> int:
    from . import incompatible

    if args.remote:
        pr.error("gc --incompatible acts on the local store; the shared tier's entries of other identities are "
                 "never served and age out by its own eviction")
        return USAGE
    keep: dict = {key.lower(): None for key in args.keep_identity}
    if args.model:
        try:
            import mlx_lm  # noqa: F401
        except ImportError as exc:
            pr.error(f"gc --incompatible --model needs mlx-lm (pip install 'kvshelf[mlx-lm]'): {exc}")
            return USAGE
        keep.update(incompatible.current_identities(
            _store_dir(args), args.model, model_id=args.model_id, kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start,
            chat_template=args.chat_template))
    doc = incompatible.gc_incompatible(_store_dir(args), keep, dry_run=args.dry_run)

    def human(console) -> None:
        for ident in doc["incompatible"]:
            console.print(f"identity {ident['identity_key']}  model {ident['model_id']}  "
                          f"config {ident['config_fingerprint'][:12]}  tokenizer {ident['tokenizer_hash'][:12]}")
            for s in ident["snapshots"]:
                console.print(f"  snapshot {s['snapshot_id']}  session {s['session_id']}  "
                              f"namespace {s['namespace']!r}  tokens {s['tokens']}")
        if args.dry_run:
            console.print(f"would remove {doc['snapshots']} snapshot(s) of {len(doc['incompatible'])} identit(ies) "
                          f"no kept identity can use; kept: {', '.join(doc['kept'])}")
        else:
            console.print(f"removed {doc['sessions_deleted']} session(s) ({doc['snapshots']} snapshot(s)) of "
                          f"{len(doc['incompatible'])} identit(ies); freed {doc['chunks_freed']} chunk(s), "
                          f"{human_bytes(doc['bytes_freed'])}; gc reclaimed {doc['objects']} object(s), "
                          f"{human_bytes(doc['bytes'])}")

    pr.emit(doc, human)
    return OK


def cmd_repair(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    with admin.open_admin(_store_dir(args)) as store:
        doc = admin.repair(store, dry_run=args.dry_run, remote=args.remote, remote_prefix=args.remote_prefix)

    def human(console) -> None:
        dry = args.dry_run  # a dry run says what it would do, in the words of the run that does it
        rows = [("would heal" if dry else "healed", ", ".join(c["sessions"]), c["chunk"],
                 f"{'would rewrite' if dry else 'rewritten'} from its good copy in {c['source']}")
                for c in doc["healed"]]
        rows += [("would drop (lost)" if dry else "dropped (lost)", r["session_id"], r["snapshot_id"],
                  f"uses damaged chunk(s) {', '.join(r['chunks'])} with no good copy") for r in doc["lost"]]
        rows += [("would rewrite trailer" if dry else "trailer rewritten", "", p,
                  "its live chunks and manifests copied under fresh trailers") for p in doc["rewritten_trailers"]]
        rows += [("would drop orphan checkpoint" if dry else "orphan checkpoint dropped", "", sid,
                  "its session is gone") for sid in doc["dropped_checkpoints"]]
        rows += [("would drop quarantine" if dry else "quarantine dropped", q["session_id"], q["snapshot_id"],
                  "its evidence may then be reclaimed") for q in doc["dropped_quarantined"]]
        healed, lost, quarantine = len(doc["healed"]), len(doc["lost"]), len(doc["dropped_quarantined"])
        if dry:
            title = (f"repair --dry-run (nothing changed): would heal {healed} chunk(s), drop {lost} lost "
                     f"session(s) and {quarantine} quarantine record(s)")
        else:
            title = (f"repair: healed {healed} chunk(s), dropped {lost} lost session(s) and {quarantine} "
                     f"quarantine record(s)")
        console.print(rows_table(title, ("action", "session(s)", "snapshot / chunk", "why"), rows,
                                 whole=("snapshot / chunk",)))
        console.print(f"would reclaim {doc['reclaimed_objects']} object(s), {human_bytes(doc['reclaimed_bytes'])}"
                      if dry else f"reclaimed {doc['reclaimed_objects']} object(s), "
                                  f"{human_bytes(doc['reclaimed_bytes'])}")
        for line in doc["remaining"]:
            console.print(f"still damaged: {line}")

    pr.emit(doc, human)
    return PROBLEMS if doc["remaining"] else OK


def cmd_quarantine(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    if args.action == "drop" and (args.snapshot is None) == (not args.all):
        pr.err.print("quarantine drop needs exactly one of a snapshot ID or --all")
        return USAGE
    with admin.open_admin(_store_dir(args)) as store:
        if args.action == "ls":
            doc = admin.quarantine_ls(store)
        else:
            doc = admin.quarantine_drop(store, None if args.all else args.snapshot)

    def human(console) -> None:
        if args.action == "drop":
            console.print(f"dropped {len(doc['dropped'])} quarantine record(s); run `kvshelf gc` to reclaim")
            return
        console.print(rows_table(f"{len(doc['quarantined'])} quarantined snapshot(s)",
                                 ("snapshot", "session", "reason"),
                                 [(q["snapshot_id"], q["session_id"], q["reason"]) for q in doc["quarantined"]],
                                 whole=("snapshot",)))
        console.print(rows_table(f"{len(doc['bad_chunks'])} bad chunk cop(ies)", ("chunk", "pack", "reason"),
                                 [(b["hash"], b["pack"], b["reason"]) for b in doc["bad_chunks"]], whole=("chunk",)))

    pr.emit(doc, human)
    return PROBLEMS if args.action == "drop" and args.snapshot is not None and not doc["dropped"] else OK


def cmd_compact(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin
    from .compaction import compact

    with admin.open_admin(_store_dir(args)) as store, pr.progress("compacting", None):
        report = compact(store, cold_after=args.cold_after, dry_run=args.dry_run, level=args.level)
    doc = to_data(report) | {"ratio": round(report.ratio, 4)}

    def human(console) -> None:
        title = "compaction plan (dry run)" if args.dry_run else "compaction"
        console.print(rows_table(title, ("step", "count", "bytes before", "bytes after"),
                                 [(s["name"], s["count"], human_bytes(s["bytes_before"]),
                                   human_bytes(s["bytes_after"])) for s in doc["steps"]]))
        console.print(f"total {human_bytes(doc['bytes_before'])} -> {human_bytes(doc['bytes_after'])}"
                      f" (ratio {doc['ratio']:.3f}) in {doc['seconds']:.2f}s; skipped (leased) {doc['skipped_leased']}")

    pr.emit(doc, human)
    return OK


def cmd_export(args: argparse.Namespace, pr: Printer) -> int:
    from .transfer import export_session

    doc = export_session(_store_dir(args), args.session, args.file, format=args.format, **_expect(args))
    pr.emit(doc, lambda c: c.print(f"exported {doc['session_id']} ({doc['tokens']} tokens) to {doc['file']}"))
    return OK


def cmd_import(args: argparse.Namespace, pr: Printer) -> int:
    from .transfer import import_files

    if args.session is not None and len(args.files) > 1:
        pr.error("--session names one session; give one FILE with it")
        return USAGE
    with pr.progress("importing", len(args.files)) as advance:
        results = import_files(_store_dir(args), args.files, session_id=args.session, progress=advance,
                               chunk_tokens=args.chunk_tokens, tokens=args.tokens, **_expect(args))
    failed = [r for r in results if r["status"] == "failed"]

    def human(console) -> None:
        console.print(rows_table("import", ("file", "status", "session", "detail"),
                                 [(r["file"], r["status"], r.get("session_id"), r.get("detail", "")) for r in results],
                                 whole=("session",)))

    pr.emit({"results": results, "failed": len(failed)}, human)
    return PROBLEMS if failed else OK


def cmd_rebuild_index(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    with pr.progress("rebuilding the index", None):
        doc = admin.rebuild_index(_store_dir(args))
    pr.emit(doc, lambda c: c.print(kv_table("rebuilt index", list(to_data(doc).items()))))
    return OK


def cmd_watch(args: argparse.Namespace, pr: Printer) -> int:
    from .transfer import watch_inbox

    stats = watch_inbox(_store_dir(args), args.inbox, settle=args.settle, compact_every=args.compact_every,
                        until_idle=args.exit_when_idle, log=pr.message, chunk_tokens=args.chunk_tokens,
                        **_expect(args))
    doc = {"done": stats.done, "failed": stats.failed, "compactions": stats.compactions,
           "files": [to_data(o) | {"result": None} for o in stats.outcomes]}
    pr.emit(doc, lambda c: c.print(f"watch stopped: {stats.done} ingested, {stats.failed} failed"))
    return PROBLEMS if stats.failed else OK  # a rejected file is a problem found, like verify's corruption

def cmd_pin(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    with admin.open_admin(_store_dir(args)) as store:
        store.pins.set_limit(args.max_pinned_bytes)
        pins = store.pin(args.session, args.namespace, ttl=args.ttl)
    doc = {"pinned": [{"session_id": p.session_id, "namespace": p.namespace, "bytes": p.nbytes,
                       "expires_at": p.expires_at} for p in pins]}
    pr.emit(doc, lambda c: c.print(f"pinned {args.session!r} ({len(pins)} identit{'y' if len(pins) == 1 else 'ies'}, "
                                   f"{human_bytes(sum(p.nbytes for p in pins))})"
                                   + ("" if args.ttl is None else f", TTL {args.ttl:g}s after its last use")))
    return OK


def cmd_delete(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    doc = admin.delete_session(_store_dir(args), args.session, **_expect(args))
    pr.emit(doc, lambda c: c.print(f"deleted {doc['session_id']!r} (namespace {doc['namespace']!r}, model "
                                   f"{doc['model_id']}); `kvshelf gc` reclaims what no other session uses"))
    return OK


def cmd_unpin(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    with admin.open_admin(_store_dir(args)) as store:
        dropped = store.unpin(args.session, args.namespace)
    pr.emit({"unpinned": dropped}, lambda c: c.print(f"unpinned {args.session!r}" if dropped else
                                                     f"{args.session!r} was not pinned"))
    return OK if dropped else PROBLEMS


def cmd_forget(args: argparse.Namespace, pr: Printer) -> int:
    from . import admin

    if args.remote:
        doc = {"tenant": args.tenant, "remote_entries": admin.remote_forget_tenant(args.remote, args.tenant,
                                                                                   args.remote_prefix)}
    else:
        with admin.open_admin(_store_dir(args)) as store:
            doc = {"tenant": args.tenant, **store.forget_tenant(args.tenant)}
    pr.emit(doc, lambda c: c.print(f"forgot tenant {args.tenant!r}: " + ", ".join(
        f"{k}={v}" for k, v in doc.items() if k != "tenant")))
    return OK


def cmd_warm(args: argparse.Namespace, pr: Printer) -> int:
    import json

    try:
        from mlx_lm import load

        from ..mlx_lm.serve import warm
        from ..mlx_lm.serve.model_identity import model_identity
    except ImportError as exc:
        pr.error(f"kvshelf warm needs mlx-lm (pip install 'kvshelf[mlx-lm]'): {exc}")
        return USAGE
    from ..store import open_store

    try:
        template_args = json.loads(args.chat_template_args)
    except ValueError as exc:
        raise KvShelfError(f"--chat-template-args: not JSON: {exc}") from None
    items = warm.read_warm_prompts(args.file)
    identity = model_identity(args.model, model_id=args.model_id, fingerprints=_store_dir(args))
    model, tokenizer = load(args.model)
    with open_store(str(_store_dir(args)), identity=identity) as store:
        store.pins.set_limit(args.max_pinned_bytes)
        report = warm.warm(model, tokenizer, store, items, namespace=args.namespace, pin=args.pin,
                           pin_ttl=args.ttl, chat_template_args=template_args)
    doc = {"prompts": report.prompts, "prefilled": report.prefilled, "from_store": report.from_store,
           "pinned": report.pinned, "refused_pins": report.refused_pins, "sessions": report.sessions}
    pr.emit(doc, lambda c: c.print(report.line() + (f" pinned={report.pinned}" if args.pin else "")))
    return PROBLEMS if report.refused_pins else OK


COMMANDS = {
    "demo": cmd_demo, "ls": cmd_ls, "show": cmd_show, "stats": cmd_stats, "verify": cmd_verify, "gc": cmd_gc,
    "compact": cmd_compact, "export": cmd_export, "import": cmd_import, "rebuild-index": cmd_rebuild_index,
    "watch": cmd_watch, "delete": cmd_delete, "pin": cmd_pin, "unpin": cmd_unpin, "warm": cmd_warm, "repair": cmd_repair,
    "quarantine": cmd_quarantine, "forget": cmd_forget,
}


def cmd_serve(argv: Sequence[str]) -> int:
    """``kvshelf serve``: every argument goes to :mod:`kvshelf.mlx_lm.serve.server` (ours and mlx_lm.server's)."""
    try:
        from ..mlx_lm.serve.server import main as serve_main
    except ImportError as exc:  # the core works without mlx-lm; serving needs it
        print(f"kvshelf serve needs mlx-lm (pip install 'kvshelf[mlx-lm]'): {exc}", file=sys.stderr)
        return USAGE
    return serve_main(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Never a traceback: a ``KvShelfError`` or an ``OSError`` is one clear line on stderr (and an
    ``{"error", "message"}`` document with ``--json``) and exit 1; anything else is reported the same way as an
    internal error, also exit 1; usage errors are argparse's exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # its options are mlx_lm.server's too: not parsed here
        return cmd_serve(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "encryption_key_file", None) is not None:  # read by admin.open_admin, for this process only
        os.environ[KEY_FILE_VAR] = str(args.encryption_key_file)
    pr = Printer(as_json=args.json)
    try:
        return COMMANDS[args.command](args, pr)
    except KvShelfError as exc:
        return _report(pr, args, exc, "")
    except OSError as exc:  # one the library did not name: still a KvShelfError naming the command and the path
        return _report(pr, args, file_error(exc, f"kvshelf {args.command}"), "")
    except Exception as exc:  # noqa: BLE001 - a bug, still one readable line: the operator's terminal is no place for a traceback
        return _report(pr, args, exc, "internal error (please report it): ")


def _report(pr: Printer, args: argparse.Namespace, exc: BaseException, prefix: str) -> int:
    message = str(exc) or repr(exc)
    pr.error(f"{prefix}{type(exc).__name__}: {message}")
    if args.json:
        pr.emit({"error": type(exc).__name__, "message": message}, lambda _c: None)
    return PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
