"""The name a client sends as ``model``: what ``GET /v1/models`` lists and which names reach the served model.

Why: mlx-lm answers ``/v1/models`` by scanning the Hugging Face cache (an empty body and a traceback in the log when
there is none) and lists a local model under its resolved absolute path, while a request naming anything but
``default_model`` or that exact path is taken for a Hugging Face repository (a 404 naming Hugging Face for
``"default"``). So nothing told a client what to send. Here the served model has one listed name, the model
directory's name (``/models/qwen3-8b`` -> ``qwen3-8b``; a repository id stays as given), and a request naming it,
``default``, ``default_model``, the ``--model`` argument or its resolved path is served by the default model. Other
names go to mlx-lm unchanged (a model it may load on demand).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

DEFAULT = "default_model"  # mlx-lm's own name of the --model it was started with


class ServedModelNames:
    """The listed name and the accepted aliases of the ``--model`` a server was started with (None: no default)."""

    def __init__(self, model: str | None, *, created: int | None = None):
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.listed: str | None = None
        self.aliases: set[str] = set()
        if model is None:
            return
        path = Path(model)
        local = path.exists()
        self.listed = (path.resolve().name or str(path)) if local else model
        self.aliases = {self.listed, "default", DEFAULT, model}
        if local:
            self.aliases |= {str(path.resolve()), str(path)}

    def resolve(self, requested: Any) -> Any:
        """mlx-lm's name for a requested ``model``: ``default_model`` for every alias, anything else unchanged."""
        return DEFAULT if isinstance(requested, str) and requested in self.aliases else requested

    def listing(self) -> dict[str, Any]:
        """The ``/v1/models`` document: the served model under its listed name (an empty list without one)."""
        return {"object": "list", "data": [] if self.listed is None else [self.entry()]}

    def entry(self, wanted: str | None = None) -> dict[str, Any] | None:
        """``/v1/models/NAME``: the served model when NAME is one of its names, else None (a 404)."""
        if self.listed is None or (wanted is not None and wanted not in self.aliases):
            return None
        return {"id": self.listed, "object": "model", "created": self.created, "owned_by": "kvshelf"}


__all__ = ["DEFAULT", "ServedModelNames"]
