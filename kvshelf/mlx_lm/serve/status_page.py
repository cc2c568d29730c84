"""The status page (``GET /kvshelf``) and its JSON twin (``GET /kvshelf/stats``).

Why one server-rendered page: an operator opens it in any browser, behind any proxy, with nothing to build or
fetch — no external assets, no JavaScript at all; it refreshes itself every 10 seconds (a meta refresh). Both views
come from one ``status()`` document, so the page and the JSON can never disagree.
"""

from __future__ import annotations

import html
import time
from typing import Any

from .metrics import ServeMetrics, store_figures
from .prompt_cache import SOURCES


def status(metrics: ServeMetrics, state: dict[str, Any], *, model: str | None, store_dir: str,
           remote: str | None) -> dict[str, Any]:
    """The whole status as plain data (``/kvshelf/stats``)."""
    figures = store_figures(state.get("stores", []))
    budget = figures["max_bytes"]
    return {
        "model": model, "store": store_dir, "remote": remote, "time": time.time(),
        "tiers": [t for t in ("ram", "disk", "remote") if t != "remote" or remote],
        "hit_rates": metrics.hit_rates(),
        **metrics.counts(),
        "store_bytes": figures["stored_bytes"], "budget_bytes": budget,
        "budget_use": round(figures["stored_bytes"] / budget, 4) if budget else None,
        "pinned_bytes": figures["pinned_bytes"], "pins": figures["pins"], "snapshots": figures["snapshots"],
        "evictions": figures["evicted"], "quarantined": figures["quarantined"], "store_error": figures["error"],
        "write_queue": {"pending": state.get("pending_writes", 0), "pending_bytes": state.get("pending_bytes", 0),
                        "capacity": state.get("queue_entries"), "counts": state.get("queue_counts", {})},
        "recent": metrics.recent(),
        "ram": state.get("ram"),  # the RAM tier's bytes, bound, peak and evictions (ram_tier.py)
    }


def _bytes(n: int | None) -> str:
    if n is None:
        return "none"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _table(caption: str, head: tuple[str, ...], rows: list[tuple], css: str = "") -> str:
    e = html.escape
    body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in rows) or \
        f"<tr><td colspan='{len(head)}'>none</td></tr>"
    return (f"<table class='{css}'><caption>{e(caption)}</caption><tr>" + "".join(f"<th>{e(h)}</th>" for h in head)
            + f"</tr>{body}</table>")


def render(doc: dict[str, Any]) -> str:
    """The HTML page of a ``status()`` document."""
    e = html.escape
    rates = doc["hit_rates"]
    rate_rows = [(w, r["requests"], _pct(r["hit"]), *(_pct(r[s]) for s in SOURCES)) for w, r in rates.items()]
    token_rows = [(w, r["prompt_tokens"], r["cached_tokens"], _pct(r["token_share"])) for w, r in rates.items()]
    miss_rows = sorted(doc["misses"].items(), key=lambda kv: -kv[1])
    pins = [(p["session_id"], p["namespace"] or '""', _bytes(p["bytes"]),
             "never" if p["expires_at"] is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                                                   time.localtime(p["expires_at"])))
            for p in doc["pins"]]
    recent = [(time.strftime("%H:%M:%S", time.localtime(r["at"])), r["source"], r["cached"], r["prompt"],
               r["reason"] or "", r["ms"]) for r in doc["recent"]]
    wq = doc["write_queue"]
    use = doc["budget_use"]
    bar = "" if use is None else (f"<div class='bar'><div style='width:{min(100.0, 100 * use):.1f}%'></div></div>")
    store_rows = [("store", doc["store"]), ("store size", _bytes(doc["store_bytes"])),
                  ("budget", _bytes(doc["budget_bytes"])), ("budget use", _pct(use)),
                  ("pinned", _bytes(doc["pinned_bytes"])), ("snapshots (this model)", doc["snapshots"]),
                  ("evictions", doc["evictions"]), ("quarantined", doc["quarantined"])]
    ram = doc.get("ram")
    if ram:
        store_rows += [("RAM tier", f"{_bytes(ram['bytes'])} of {_bytes(ram['max_bytes'])} "
                                    f"(peak {_bytes(ram['peak_bytes'])}, {ram['entries']} entries)"),
                       ("RAM evictions", ", ".join(f"{k} {v}" for k, v in ram["evictions"].items()))]
    if doc["store_error"]:
        store_rows.append(("store error", doc["store_error"]))
    write_rows = [("pending", wq["pending"]), ("pending bytes", _bytes(wq["pending_bytes"])),
                  ("capacity", wq["capacity"]), *((k, v) for k, v in doc["writes"].items()),
                  ("bytes written", _bytes(doc["bytes_written"]))]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">
<title>kvshelf serve — status</title>
<style>
body{{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}} h1{{font-size:1.3em}}
table{{border-collapse:collapse;margin:0 2em 1.5em 0;display:inline-table;vertical-align:top}}
caption{{text-align:left;font-weight:600;padding:.3em 0}} td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}
th{{background:#f3f3f3}} .bar{{width:20em;height:.8em;border:1px solid #888}} .bar div{{height:100%;background:#4a8}}
</style></head><body>
<h1>kvshelf serve</h1>
<p>model <code>{e(str(doc["model"]))}</code> · tiers {e(", ".join(doc["tiers"]))}
{f"· remote <code>{e(doc['remote'])}</code>" if doc["remote"] else ""}</p>
{bar}
{_table("Store", ("", ""), store_rows, "store")}
{_table("Hit rates by requests (a hit: at least --min-hit-tokens cached)", ("window", "requests", "hit",
        *(f"{s} (requests)" for s in SOURCES)), rate_rows, "rates")}
{_table("Hit rates by tokens (prompt tokens not recomputed)", ("window", "prompt tokens", "cached tokens",
        "cached share (tokens)"), token_rows, "token-rates")}
{_table("Requests (since start)", ("source", "requests"), list(doc["requests"].items()), "requests")}
{_table("Misses by reason", ("reason", "requests"), miss_rows, "misses")}
{_table("Write queue", ("", ""), write_rows, "writes")}
{_table("Pinned prompts", ("session", "namespace", "bytes", "expires"), pins, "pins")}
{_table("Last requests", ("time", "source", "cached", "prompt", "miss reason", "ms"), recent, "recent")}
</body></html>
"""


__all__ = ["render", "status"]
