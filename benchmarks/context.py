"""What every measure group shares in one run: the workload, repetitions, scratch space and cached data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from . import data
from .harness import Scratch


@dataclass
class Context:
    workload: data.Workload
    large: data.Workload
    reps: int
    scratch: Scratch
    facts: dict[str, Any] = field(default_factory=dict)
    _data: list[list[mx.array]] | None = None
    _caches: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def large_reps(self) -> int:
        """Repetitions for L-large operations (each moves 704 MiB)."""
        return max(2, min(self.reps, 3))

    def data(self) -> list[list[mx.array]]:
        if self._data is None:
            self._data = data.latent_data(self.workload)
        return self._data

    def tokens(self, n: int | None = None, seed: int = 1) -> list[int]:
        return data.token_ids(self.workload.tokens if n is None else n, seed)

    def caches(self, variant: str) -> list[Any]:
        """The main workload's data in one kvshelf lego per layer (built once per run)."""
        if variant not in self._caches:
            self._caches[variant] = data.kvshelf_caches(self.workload, self.data(), variant)
        return self._caches[variant]

    def drop(self, variant: str | None = None) -> None:
        """Release cached caches (all of them with ``None``) so big measures have room."""
        for key in [variant] if variant else list(self._caches):
            self._caches.pop(key, None)
        mx.clear_cache()

    def open_store(self, path, **kw):
        from kvshelf.store import Identity, open_store

        return open_store(path, identity=Identity("bench/glm-dsa-synthetic"), **kw)
