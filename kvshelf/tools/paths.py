"""Where the embedded default store lives: the one place every command (and the demo) asks.

``KVSHELF_STORE`` wins; otherwise ``$XDG_DATA_HOME/kvshelf/store`` (``~/.local/share/kvshelf/store``), a data
directory rather than a cache one because a store holds sessions people expect to find again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import InvalidCacheState, WrongArgumentType

ENV_VAR = "KVSHELF_STORE"
KEY_FILE_VAR = "KVSHELF_ENCRYPTION_KEY_FILE"  # the key file of a store encrypted at rest (--encryption-key-file)


def require_path(value: Any, what: str) -> Path:
    """A path argument of a tool: str or os.PathLike naming text, non-empty, no NUL (else a ``KvShelfError``)."""
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
        raise WrongArgumentType(f"{what} must be a str or os.PathLike path, got {type(value).__name__}")
    text = os.fspath(value)
    if not text or "\x00" in text:
        raise InvalidCacheState(f"{what} must be a non-empty path without NUL characters, got {text!r:.80}")
    return Path(text)


def require_text(value: Any, what: str) -> str:
    """An id argument of a tool (a session or snapshot id): a str."""
    if not isinstance(value, str):
        raise WrongArgumentType(f"{what} must be a str, got {type(value).__name__}")
    return value


def default_store_path() -> Path:
    """The store directory used when no ``--store`` is given."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home).expanduser() / "kvshelf" / "store"


__all__ = ["ENV_VAR", "KEY_FILE_VAR", "default_store_path", "require_path", "require_text"]
