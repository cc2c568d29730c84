"""Printing for the CLI: one JSON document with ``--json``, rich tables otherwise, progress only on a terminal.

Library results (dataclasses, msgspec Structs, named tuples) are turned into plain builtins once, here, so every
command prints the same thing in both modes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import enum
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import PurePath
from typing import Any

import msgspec
# rich imports its emoji table lazily, on the first print. When two threads print for the first time at once (the
# inbox watcher's observer thread and its main loop), one of them can see the module half-initialised and fail with
# an ImportError; importing it here, once, in the thread that imports this module, closes that window.
import rich._emoji_codes  # noqa: F401
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, _dt.datetime):
        return obj.isoformat()
    if hasattr(obj, "_asdict"):
        return to_data(obj._asdict())
    if dataclasses.is_dataclass(obj):
        return to_data({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot print a {type(obj).__name__}")


def to_data(obj: Any) -> Any:
    """Any library result as JSON-ready builtins (dicts, lists, str, int, float, bool, None)."""
    if hasattr(obj, "_asdict") and not dataclasses.is_dataclass(obj):
        obj = obj._asdict()
    return msgspec.to_builtins(obj, enc_hook=_enc_hook, str_keys=True)


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_time(ts: float | None) -> str:
    if not ts:
        return "-"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


class Printer:
    """Where a command's output goes: stdout (JSON or tables), stderr for messages."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        # piped: $COLUMNS, else 80 (rich's own rule); tables fit it by wrapping cells (``rows_table``), never by
        # cutting an id, and ``ls --ids`` prints bare ids for scripts
        self.out = Console(highlight=False, markup=False)
        self.err = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)  # an error is one line

    def emit(self, doc: Any, human: Callable[[Console], None]) -> None:
        if self.as_json:
            sys.stdout.write(json.dumps(to_data(doc), indent=2, sort_keys=True) + "\n")
            sys.stdout.flush()
        else:
            human(self.out)

    def message(self, text: str) -> None:
        if not self.as_json:
            self.err.print(text)

    def error(self, text: str) -> None:
        self.err.print(f"[bold red]error:[/] {escape(text)}", markup=True)  # messages quote paths and lists: no markup

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        """Yields ``advance(n)``; draws a bar only when stderr is a terminal (quiet when piped or with --json)."""
        if self.as_json or not self.err.is_terminal or os.environ.get("KVSHELF_NO_PROGRESS"):
            yield lambda _n=1: None
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)


def kv_table(title: str, pairs: Sequence[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("field", style="bold", overflow="fold")
    table.add_column("value", overflow="fold")
    for key, value in pairs:
        table.add_row(key, "-" if value is None else str(value))
    return table


MAX_WHOLE = 56  # an id longer than this folds (``kvshelf ls --ids`` prints any id bare)


def rows_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
               whole: Sequence[str] = ()) -> Table:
    """A table that fits the console by wrapping cells (``fold``: no character is ever replaced by an ellipsis).
    ``whole``: columns holding ids a later command takes; each keeps its longest value on one line (a minimum
    width), so an id is never split, and the other columns wrap around them."""
    cells = [["-" if v is None else str(v) for v in row] for row in rows]
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        widest = max((len(row[i]) for row in cells), default=0)
        table.add_column(column, overflow="fold", min_width=min(widest, MAX_WHOLE) if column in whole else None)
    for row in cells:
        table.add_row(*row)
    return table


__all__ = ["Printer", "to_data", "human_bytes", "human_time", "kv_table", "rows_table"]
