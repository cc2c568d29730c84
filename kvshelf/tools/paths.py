"""Where the embedded default store lives: the one place every command (and the demo) asks.

``KVSHELF_STORE`` wins; otherwise ``$XDG_DATA_HOME/kvshelf/store`` (``~/.local/share/kvshelf/store``), a data
directory rather than a cache one because a store holds sessions people expect to find again.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "KVSHELF_STORE"


def default_store_path() -> Path:
    """The store directory used when no ``--store`` is given."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home).expanduser() / "kvshelf" / "store"


__all__ = ["ENV_VAR", "default_store_path"]
