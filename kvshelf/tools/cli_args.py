"""The ``kvshelf`` command line's arguments: every subcommand, option and value parser, and nothing that runs.

Why its own file: ``cli.py`` had grown past the size limit holding two concerns, what the command line accepts and
what each command does; parsing changes (a new option) and command bodies (a new table column) rarely go together.
``cli.py`` imports ``build_parser`` and the two readers of parsed arguments (``_store_dir``, ``_expect``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .paths import ENV_VAR, default_store_path


def _duration(text: str, allow_zero: bool = False) -> float:
    from .watcher import parse_duration

    try:
        return parse_duration(text, allow_zero=allow_zero)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _zstd_level(text: str) -> int:
    try:
        level = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"zstd level must be an integer 1-22, got {text!r}") from None
    if not 1 <= level <= 22:
        raise argparse.ArgumentTypeError(f"zstd level must be 1-22, got {level}")
    return level


def _tokens(text: str) -> list[int]:
    import json

    try:
        if text.startswith("@"):
            values = json.loads(Path(text[1:]).read_text())
        else:
            values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"token ids must be 1,2,3 or @file.json (a JSON list): {exc}") from None
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in values):
        raise argparse.ArgumentTypeError("token ids must be non-negative integers")
    return values


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--store",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"store directory (default: ${ENV_VAR}, else {default_store_path()})",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    common.add_argument("--encryption-key-file", type=Path, default=None, metavar="FILE",
                        help="the key of a store encrypted at rest (32 bytes, 64 hex digits or a passphrase; default "
                             "$KVSHELF_ENCRYPTION_KEY_FILE): without it, chunk contents are not read")
    return common


def _remote_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("shared tier")
    group.add_argument("--remote", default=None, metavar="URL",
                       help="act on the shared tier instead of the local store: redis://host:port/db, rediss://..., "
                            "redis+cluster://host:port")
    group.add_argument("--remote-prefix", default=None, metavar="PREFIX", help="key prefix (default kvshelf:)")


def _identity_options(parser: argparse.ArgumentParser, *, required_note: str = "") -> None:
    group = parser.add_argument_group("identity" + (f" ({required_note})" if required_note else ""))
    group.add_argument("--model-id", default=None, help="model id the snapshots were made under")
    group.add_argument("--config-fingerprint", default=None, help="model config fingerprint")
    group.add_argument("--tokenizer-hash", default=None, help="tokenizer hash")
    group.add_argument("--namespace", default=None, help="namespace (adapter/tenant); default: any / the file's")


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="kvshelf",
        description="Inspect, check, repair, shrink and move a kvshelf session store.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help_text, description=help_text)

    add("demo", "Run the synthetic-model demo on the store (save, restore, prefix reuse, batch restore).")
    p = add("ls", "List stored sessions: namespace, identity, tokens, bytes, times, floor, kinds and formats.")
    p.add_argument("--ids", action="store_true",
                   help="print only the session ids, one a line (each pastes into `kvshelf pin ID`)")
    _identity_options(p, required_note="filters; default: every identity")
    p.add_argument("--tenant", default=None, metavar="T", help="only this tenant's sessions (every namespace of it)")
    _remote_options(p)
    p = add("show", "Show the header of one snapshot (geometry, format, block table, chunks) without loading tensors.")
    p.add_argument("target", metavar="SESSION|SNAPSHOT", help="a session id (its latest snapshot) or a snapshot id")
    _identity_options(p, required_note="filters; default: every identity")
    p = add("stats", "Totals, deduplication and compression ratios, budget use, chunk and orphan counts.")
    p.add_argument("--max-bytes", type=int, default=None, metavar="BYTES",
                   help="the serving processes' byte budget, to report budget use against")
    _remote_options(p)
    p = add("verify", "Check headers and manifests against the chunks; exit 1 if anything is wrong.")
    p.add_argument("--deep", action="store_true", help="also re-hash every chunk")
    p = add("gc", "Remove orphan chunks and unreferenced chunks; with --incompatible, also every snapshot no "
                  "identity in service can use.")
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    _remote_options(p)
    group = p.add_argument_group("--incompatible: the identities in service (the rest is reclaimed)")
    group.add_argument("--incompatible", action="store_true",
                       help="remove the snapshots of every identity not named by --model / --keep-identity")
    group.add_argument("--model", action="append", default=[], metavar="DIR",
                       help="a model directory in service, fingerprinted as `kvshelf serve` with the options below "
                            "would (repeatable)")
    group.add_argument("--model-id", default=None, metavar="NAME", help="the servers' --model-id, if given")
    group.add_argument("--kv-bits", type=int, default=None, metavar="N", help="the servers' --kv-bits, if given")
    group.add_argument("--kv-group-size", type=int, default=64, metavar="N", help="their --kv-group-size (64)")
    group.add_argument("--quantized-kv-start", type=int, default=5000, metavar="N",
                       help="their --quantized-kv-start (5000)")
    group.add_argument("--chat-template", default=None, metavar="TEMPLATE", help="their --chat-template, if given")
    group.add_argument("--keep-identity", action="append", default=[], metavar="KEY",
                       help="also keep this identity (the 32-hex key a --dry-run lists; repeatable)")
    p = add("repair", "Heal damaged chunks from a good copy (another pack, the shared tier), drop what cannot be read "
                      "(sessions using a chunk with no good copy, quarantined snapshots), reclaim the space, print "
                      "what was done and lost.")
    p.add_argument("--dry-run", action="store_true", help="only report what would be done; change nothing")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="also take good copies of damaged chunks from this shared tier (redis://host:port/db, ...)")
    p.add_argument("--remote-prefix", default=None, metavar="PREFIX", help="its key prefix (default kvshelf:)")
    p = add("quarantine", "List quarantined snapshots and bad chunk copies, or drop quarantine records.")
    p.add_argument("action", choices=("ls", "drop"), help="ls: list; drop: forget a record (gc may then reclaim)")
    p.add_argument("snapshot", nargs="?", default=None, metavar="ID", help="the snapshot id to drop")
    p.add_argument("--all", action="store_true", help="with drop: every quarantine record")
    p = add("compact", "Recompress cold chunks, densify paged tables, merge small chunks, drop orphans, shrink LMDB.")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    p.add_argument("--cold-after", type=lambda t: _duration(t, allow_zero=True), default=3600.0, metavar="DURATION",
                   help="a chunk not used for this long is cold (default 1h; 0s: every chunk)")
    p.add_argument("--level", type=_zstd_level, default=3, metavar="N",
                   help="zstd level for cold chunks, 1-22 (default 3; higher: smaller and slower to write)")
    p = add("export", "Write a session's latest snapshot as one portable safetensors file.")
    p.add_argument("session", help="session id")
    p.add_argument("file", type=Path, help="output file (written atomically, mode 0600)")
    p.add_argument("--format", choices=("kvshelf", "mlx-lm"), default="kvshelf",
                   help="kvshelf: a portable snapshot file (default); mlx-lm: a file mlx-lm's load_prompt_cache "
                        "loads (sessions saved from mlx-lm's caches; needs mlx-lm)")
    _identity_options(p, required_note="default: the only identity holding the session")
    p = add("import", "Verify portable snapshot files (or mlx-lm save_prompt_cache files) completely, then add them "
                      "to the store (idempotent).")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE")
    p.add_argument("--session", default=None, help="session id (default: each file's name without suffix)")
    p.add_argument("--tokens", type=_tokens, default=None, metavar="IDS",
                   help="token ids an mlx-lm file encodes when it carries none: 1,2,3 or @ids.json (a JSON list)")
    p.add_argument("--chunk-tokens", type=int, default=256, metavar="N", help="chunk length for new chunks (default 256)")
    _identity_options(p, required_note="expected identity; a file made under another is refused")
    add("rebuild-index", "Rebuild the LMDB index from the packs alone.")
    p = add("watch", "Ingest every portable snapshot file dropped into INBOX; done/ and failed/ hold the results.")
    p.add_argument("inbox", type=Path, metavar="INBOX")
    p.add_argument("--compact-every", type=_duration, default=None, metavar="DURATION",
                   help="run compaction between ingests at most this often (e.g. 30m)")
    p.add_argument("--settle", type=_duration, default=_duration("1s"), metavar="DURATION",
                   help="a file must hold still this long before it is read (default 1s)")
    p.add_argument("--exit-when-idle", type=_duration, default=None, metavar="DURATION",
                   help="stop after nothing arrived for this long (for batch jobs and tests)")
    p.add_argument("--chunk-tokens", type=int, default=256, metavar="N", help="chunk length for new chunks (default 256)")
    _identity_options(p, required_note="expected identity; files made under another go to failed/")
    p = add("pin", "Pin a session: the budget and the LRU never evict it (until unpin or its TTL lapses).")
    p.add_argument("session", help="session id")
    p.add_argument("--namespace", default="", metavar="NS", help='the session\'s namespace (default "")')
    p.add_argument("--ttl", type=_duration, default=None, metavar="DURATION",
                   help="the pin lapses this long after the session's last use (e.g. 7d; default never)")
    p.add_argument("--max-pinned-bytes", type=int, default=None, metavar="BYTES",
                   help="refuse the pin when pins would hold more than this")
    p = add("delete", "Delete a session (its latest snapshot and its checkpoints); chunks no other session uses are "
                      "freed, `kvshelf gc` reclaims what is left.")
    p.add_argument("session", help="session id")
    _identity_options(p, required_note="default: the only identity and namespace holding the session")
    p = add("forget", "Forget a tenant: remove every snapshot, checkpoint, pin (and with --remote, every shared-tier "
                      "entry) of it; with encryption at rest its data key is destroyed first. Chunks left "
                      "unreferenced go at the next gc.")
    p.add_argument("--tenant", required=True, metavar="T", help="the tenant to forget")
    _remote_options(p)
    p = add("unpin", "Drop a session's pin; the budget may evict it again.")
    p.add_argument("session", help="session id")
    p.add_argument("--namespace", default="", metavar="NS", help='the session\'s namespace (default "")')
    p = add("warm", "Prefill the prompts of a JSON Lines file into the store offline, as `kvshelf serve "
                    "--warm-prompts` does (needs mlx-lm).")
    p.add_argument("file", type=Path, metavar="FILE",
                   help='JSON Lines: {"messages": [...]} chat requests or {"prompt": "..."}')
    p.add_argument("--model", required=True, metavar="DIR", help="the model directory the server serves")
    p.add_argument("--model-id", default=None, metavar="NAME", help="the server's --model-id, if it gives one")
    p.add_argument("--namespace", default="", metavar="NS", help="the server's --cache-namespace (default \"\")")
    p.add_argument("--pin", action="store_true", help="pin the warmed prompts")
    p.add_argument("--ttl", type=_duration, default=None, metavar="DURATION", help="with --pin: the pins' TTL")
    p.add_argument("--max-pinned-bytes", type=int, default=None, metavar="BYTES",
                   help="with --pin: pins may hold at most this much")
    p.add_argument("--chat-template-args", default="{}", metavar="JSON",
                   help="the server's --chat-template-args (they change the prompt tokens)")
    p = sub.add_parser("serve", add_help=False, help="Serve a model with mlx-lm's OpenAI-compatible server and a "
                       "persistent prompt cache in the store (needs mlx-lm; `kvshelf serve --help` for options).")
    p.add_argument("serve_args", nargs=argparse.REMAINDER)
    return parser


def _store_dir(args: argparse.Namespace) -> Path:
    return args.store if args.store is not None else default_store_path()


def _expect(args: argparse.Namespace) -> dict[str, str]:
    fields = ("model_id", "config_fingerprint", "tokenizer_hash", "namespace")
    return {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
