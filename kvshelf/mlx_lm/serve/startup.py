"""Fail fast: what ``kvshelf serve`` checks before it listens, so a start-up mistake is a clear message and a
non-zero exit instead of a server that listens and answers every request with an error.

Why: a wrong ``--model`` used to be logged as "store unavailable", then mlx-lm's generation thread died and the
server kept listening; a ``--store`` that is a file started a RAM-only server with one warning line. The checks here
run before anything heavy (the model's files, the store directory, the remote URL); loading the model and opening
the store follow in ``server.py`` before the HTTP server starts, each turned into a ``StartupError`` naming what
failed. After start-up nothing here applies: the store never takes a running server down.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ...errors import KvShelfError


class StartupError(KvShelfError):
    """``kvshelf serve`` cannot start; the message names the option and the problem."""


def check_model_dir(model: str) -> None:
    """A local directory must hold config.json; a name that is not a directory must be in the local Hugging Face
    cache (nothing is downloaded here; mlx-lm itself may still download a repo id when the cache lacks it)."""
    from .model_identity import ModelFilesError, resolve_model_dir

    p = Path(model).expanduser()
    if p.exists() and not p.is_dir():
        raise StartupError(f"--model {model}: not a directory (a model directory holds config.json and weights)")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise StartupError(f"--model {model}: no config.json in this directory, so it is not a model directory")
        return
    if os.sep in model or model.startswith("."):
        raise StartupError(f"--model {model}: no such directory")
    try:
        resolve_model_dir(model)
    except ModelFilesError:
        return  # a hub repo id not cached yet: mlx-lm downloads it; a failure there is reported when it loads


def check_store_dir(store: str | os.PathLike) -> None:
    """``--store`` must be a directory this process can create files in (created when missing)."""
    p = Path(store).expanduser()
    if p.exists() and not p.is_dir():
        raise StartupError(f"--store {store}: exists and is not a directory (a store is a directory)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"--store {store}: cannot create the store directory: {exc.strerror or exc}") from None
    try:
        with tempfile.TemporaryFile(dir=p, prefix=".kvshelf-probe-"):
            pass
    except OSError as exc:
        raise StartupError(f"--store {store}: the store directory is not writable: {exc.strerror or exc}") from None


def check_remote(remote: str | None, prefix: str, options: dict[str, Any]) -> None:
    """A ``--remote`` URL that redis-py cannot parse (or a scheme the shared tier does not speak) and a bad
    ``--remote-prefix`` end the start; an unreachable server does not (remote faults are misses)."""
    if remote is None:
        return
    from ...store.remote import check_prefix, connect, redact

    try:
        check_prefix(prefix)
        client = connect(remote, **{k: v for k, v in options.items() if k not in _TIER_OPTIONS})
    except KvShelfError as exc:
        raise StartupError(f"--remote {redact(remote)}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise StartupError(f"--remote {redact(remote)}: {type(exc).__name__}: {exc}") from None
    try:
        client.close()
    except Exception:  # noqa: BLE001 - nothing was connected; closing is tidiness only
        pass


_TIER_OPTIONS = ("queue_size", "keep_local", "fetch_batch_bytes", "breaker", "direct_reads", "close_timeout")


def parse_remote_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value that reads as JSON (``true``, ``5``, ``"x"``) is that value, else the text."""
    import json

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise StartupError(f"--remote-option {pair!r}: expected KEY=VALUE (e.g. keep_local=false)")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


__all__ = ["StartupError", "check_model_dir", "check_remote", "check_store_dir", "parse_remote_options"]
