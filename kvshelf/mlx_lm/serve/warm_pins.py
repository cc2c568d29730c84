"""What ``--pin-warm`` pinned before, so that a restart never pins again what an operator unpinned.

Why: ``--pin-warm`` runs at every start. Pinning every warm prompt again at each start undid ``kvshelf unpin``: an
operator who freed a warm prompt's space saw it pinned after the next deploy. The store's pins record what is
pinned, not what was unpinned, so the server keeps its own small ledger, ``warm-pins.json`` in the store directory:
the (namespace, session) pairs ``--pin-warm`` has pinned. At a start, a warm session in the ledger that is no longer
pinned was unpinned (or its TTL lapsed: a prompt unused for that long) and is left alone; one not in the ledger is
pinned and recorded. ``kvshelf pin`` pins such a session again by hand, as for any session.

The file is rewritten whole through a temporary file and ``os.replace`` (a crash leaves the old or the new one);
one that cannot be read counts as empty (pinning a warm prompt once more is the safe side).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("kvshelf.serve")

FILENAME = "warm-pins.json"


class WarmPinLedger:
    """The (namespace, session id) pairs ``--pin-warm`` pinned in the store at ``store_dir``."""

    def __init__(self, store_dir: str | os.PathLike):
        self.path = Path(store_dir) / FILENAME
        self._pairs = self._read()

    def _read(self) -> set[tuple[str, str]]:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            return {(str(ns), str(sid)) for ns, sid in doc.get("pinned", [])}
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("kvshelf warm: %s cannot be read (%s: %s); warm prompts are pinned as if never before",
                        self.path, type(exc).__name__, exc)
            return set()

    def pinned_before(self, namespace: str, session_id: str) -> bool:
        return (namespace, session_id) in self._pairs

    def record(self, namespace: str, session_id: str) -> None:
        if (namespace, session_id) in self._pairs:
            return
        self._pairs.add((namespace, session_id))
        tmp = self.path.with_name(f".{FILENAME}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"pinned": sorted(self._pairs)}), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:  # the pin stands; only the memory of it is lost (a later start may pin it again)
            log.warning("kvshelf warm: cannot write %s: %s: %s", self.path, type(exc).__name__, exc)


__all__ = ["FILENAME", "WarmPinLedger"]
