"""Anthropic's ``cache_control`` breakpoints made durable: the prefix up to a breakpoint is stored as its own session
and pinned in the store for the breakpoint's ``ttl`` (``"5m"`` default, ``"1h"``), refreshed on every request that
carries the breakpoint again.

Why pins and not a second cache: the store already has pins that the budget and the LRU respect, that expire a TTL
after the session's last use and that ``--max-pinned-bytes`` bounds (``kvshelf.store.space.pins``); ``kvshelf ls``
and the status page list them with their expiry. What a breakpoint adds is a *session of exactly that prefix*: the
token position where the breakpoint's block ends (found as mlx-lm finds the system prompt's end — the template of
the messages up to that block, compared token by token with the prompt) becomes one more segment boundary, so
mlx-lm's generator inserts the cache there and the tiered prompt cache writes it behind as its own session
(``session_id_for`` those tokens). Once that write is done (or the store held those tokens already, in a longer
session), the session holding them is pinned. A pin refused by ``--max-pinned-bytes`` is logged and the request is
served anyway: a breakpoint is a hint, never a reason to fail.

Clock: the pins' "now" is the store's clock; ``KVSHELF_TEST_CLOCK_OFFSET`` (seconds, a test seam) moves it, so a
test sees a 5-minute pin lapse without waiting 5 minutes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from ...errors import KvShelfError, SnapshotNotFound

log = logging.getLogger("kvshelf.serve")

TTLS = {"5m": 300.0, "1h": 3600.0}
CLOCK_OFFSET_ENV = "KVSHELF_TEST_CLOCK_OFFSET"
WRITE_WAIT = 120.0  # seconds a pin waits for its prefix's write-behind
BREAKPOINT = "system"  # the segment type of a breakpoint's boundary (mlx-lm's RAM LRU keeps system prefixes longest)


def store_clock():
    """The clock ``open_store`` is given: None (the store's default) unless the test seam sets an offset."""
    raw = os.environ.get(CLOCK_OFFSET_ENV)
    if not raw:
        return None
    offset = float(raw)
    return lambda: time.time() + offset


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cut_segments(segments: Sequence[Sequence[int]], types: Sequence[str], ends: Sequence[int],
                 kind: str = BREAKPOINT) -> tuple[list[list[int]], list[str]]:
    """mlx-lm's segments also cut at the absolute positions ``ends``: a piece ending at such a position gets
    ``kind``; the last piece of a segment keeps the segment's type."""
    out, out_types, pos = [], [], 0
    wanted = sorted(set(ends))
    for seg, t in zip(segments, types):
        seg = list(seg)
        start, end = pos, pos + len(seg)
        for cut in wanted:
            if start < cut < end:
                out.append(seg[start - pos:cut - pos])
                out_types.append(kind)
                start = cut
        out.append(seg[start - pos:])
        out_types.append(t)
        pos = end
    return out, out_types


class CacheBreakpoints:
    """The server's breakpoints: boundaries while tokenizing (generation thread), pins after serving (a thread per
    pin). ``queue`` is the prompt cache's write-behind queue (a prefix is pinned once its write left it),
    ``store_for(model_key)`` the server's store opener (None: no disk tier now), ``namespace`` the
    ``--cache-namespace`` a request's tenant scope is appended to."""

    def __init__(self, queue: Any, store_for: Any, namespace: str = ""):
        self.queue, self.store_for, self.namespace = queue, store_for, namespace
        self.counters = {"pinned": 0, "refused": 0, "failed": 0}

    def announce(self, request: Any, translated: Any) -> None:
        """Called in the handler before ``generate``: the breakpoints travel with the request."""
        request.kvshelf_breakpoints = list(translated.breakpoints)
        request.kvshelf_breakpoint_ends = []

    def split(self, tokenizer: Any, request: Any, prompt: Sequence[int], segments: list, types: list,
              template_args: dict | None = None) -> tuple[list, list]:
        """In ``tokenize_request``: where each breakpoint's prefix ends in ``prompt``, added as segment ends."""
        wanted = getattr(request, "kvshelf_breakpoints", None)
        if not wanted:
            return segments, types
        ends: list[tuple[int, str]] = []
        messages = request.messages
        n_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
        for bp in wanted:
            if bp["where"] in ("system", "tools"):
                upto = messages[:n_system] + [{"role": "user", "content": ""}]
            else:
                upto = messages[:bp["index"] + 1]
            try:
                rendered = tokenizer.apply_chat_template(upto, tools=request.tools, tokenize=True,
                                                         add_generation_prompt=False, **(template_args or {}))
            except Exception as exc:  # noqa: BLE001 - a template that cannot end there: no boundary, served anyway
                log.warning("kvshelf cache_control: no boundary for a %s breakpoint: %s", bp["where"],
                            type(exc).__name__)
                continue
            end = _common(rendered, prompt)
            if 0 < end < len(prompt):
                ends.append((end, bp["ttl"]))
        request.kvshelf_breakpoint_ends = sorted(ends)
        if not ends:
            return segments, types
        return cut_segments(segments, types, [e for e, _ttl in ends])

    @staticmethod
    def prefix_end(request: Any) -> int:
        """Where the last breakpoint's prefix ends (0: none): usage's ``cache_creation_input_tokens`` bound."""
        ends = getattr(request, "kvshelf_breakpoint_ends", None) or []
        return max((e for e, _ttl in ends), default=0)

    def served(self, request: Any, ctx: Any, model_key: Any) -> None:
        """After the reply: pin (or re-pin: the TTL restarts) each breakpoint's prefix once it is stored."""
        ends = getattr(request, "kvshelf_breakpoint_ends", None) or []
        if not ends:
            return
        scope = getattr(getattr(request, "kvshelf_context", None), "scope", "")
        prompt = list(ctx.prompt)
        for end, ttl in ends:
            threading.Thread(target=self._pin, args=(model_key, prompt[:end], scope, TTLS[ttl]),
                             name="kvshelf-cache-control", daemon=True).start()

    def _pin(self, model_key: Any, tokens: list[int], scope: str, ttl: float) -> None:
        from .prompt_cache import session_id_for

        queued_as = f"{scope}\x00{session_id_for(tokens)}"
        deadline = time.monotonic() + WRITE_WAIT
        while self.queue.busy(queued_as) and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            store = self.store_for(model_key)
        except Exception:  # noqa: BLE001 - the opener logs its own failures; no store, no pin
            store = None
        if store is None:
            return
        namespace = self.namespace + scope
        session = session_id_for(tokens)
        try:
            try:  # the prefix's own session (the breakpoint's segment end was written as one)
                pins = store.pin(session, namespace, ttl=ttl)
            except SnapshotNotFound:  # skipped as a duplicate: a longer session already held these tokens
                hit = store.lookup([*tokens, 0], namespace)
                if hit is None or hit.length < len(tokens):
                    self.counters["failed"] += 1
                    log.warning("kvshelf cache_control: the %d-token prefix is not stored; not pinned", len(tokens))
                    return
                session = hit.session_id
                pins = store.pin(session, namespace, ttl=ttl)
        except KvShelfError as exc:  # PinLimitExceeded (--max-pinned-bytes), or the session went meanwhile
            self.counters["refused"] += 1
            log.warning("kvshelf cache_control: pin refused: %s", exc)
            return
        except Exception as exc:  # noqa: BLE001 - a breakpoint is a hint: log, never fail a request for it
            self.counters["failed"] += 1
            log.warning("kvshelf cache_control: pin failed: %s: %s", type(exc).__name__, exc)
            return
        self.counters["pinned"] += 1
        expires = min((p.expires_at for p in pins if p.expires_at is not None), default=None)
        log.info("kvshelf cache_control pinned tokens=%d ttl=%.0f session=%s expires_at=%s", len(tokens), ttl,
                 session, f"{expires:.0f}" if expires is not None else "never")


__all__ = ["CLOCK_OFFSET_ENV", "CacheBreakpoints", "TTLS", "cut_segments", "store_clock"]
