"""Codecs of the latent adapters ``kvshelf.mlx_lm.make_prompt_cache`` builds (``MLALatentCache``, ``DSALatentCache``).

An adapter is a face over one latent lego, so its entry is the lego's entry (``mla``, ``mla-dsa``,
``latent-encoded``, ``latent-paged`` — written and read by that kind's codec in the default provider, tensors,
prefix rules and the store's direct batch path included) under the adapter's kind, with two scalars in ``extra``:
the lego's own kind (``mlx-lm.inner``) and the model dtype the adapter hands its reads to mlx-lm in
(``mlx-lm.dtype``). Nothing is duplicated: every call unwraps the entry, delegates to the lego's codec and wraps the
lego it gets back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import msgspec

from ...codecs import validate
from ...codecs.header import CacheEntry
from ..latent.dsa import DSALatentCache
from ..latent.faces import DTYPES, MLALatentCache, dtype_name

INNER, DTYPE = "mlx-lm.inner", "mlx-lm.dtype"


def _provider():
    from ...codecs import default_provider  # looked up when used: the provider loads this module as a plugin

    return default_provider


class LatentAdapterCodec:
    """One adapter class <-> its lego's entry under the adapter kind (see the module docstring)."""

    format_tag = 1  # the layout tag served identities include (``MlxCodec.format_tag`` says why)

    def __init__(self, kind: str, adapter: type) -> None:
        self.kind = kind
        self.adapter = adapter

    def __repr__(self) -> str:
        return f"LatentAdapterCodec({self.kind!r})"

    def matches(self, cache: object) -> bool:
        return type(cache) is self.adapter

    # -- entry wrapping ------------------------------------------------------------------------------------------
    def _wrap(self, inner: CacheEntry, dtype: mx.Dtype | None) -> CacheEntry:
        extra = {**inner.extra, INNER: inner.kind, DTYPE: dtype_name(dtype) or ""}
        return msgspec.structs.replace(inner, kind=self.kind, extra=extra)

    def _unwrap(self, entry: CacheEntry, index: int | None = None) -> tuple[Any, CacheEntry, mx.Dtype | None]:
        """The lego's codec, the lego's entry and the reads' dtype of an adapter entry."""
        if entry.kind != self.kind:
            raise validate.incompatible(entry, index, "kind", f"expected {self.kind!r}")
        inner_kind, dtype = entry.extra.get(INNER), entry.extra.get(DTYPE)
        if not isinstance(inner_kind, str) or inner_kind.startswith("mlx-lm."):
            raise validate.incompatible(entry, index, f"extra.{INNER}", f"names no latent lego kind ({inner_kind!r})")
        if dtype not in ("", *DTYPES):
            raise validate.incompatible(entry, index, f"extra.{DTYPE}", f"unknown model dtype {dtype!r}")
        codec = _provider().for_entry(inner_kind)
        extra = {k: v for k, v in entry.extra.items() if k not in (INNER, DTYPE)}
        inner = msgspec.structs.replace(entry, kind=inner_kind, extra=extra)
        return codec, inner, DTYPES.get(dtype)

    def _check_lego(self, lego: Any, entry: CacheEntry, index: int | None) -> Any:
        wants_index = self.adapter is DSALatentCache
        if getattr(getattr(lego, "geometry", None), "has_index", None) is not wants_index:
            which = "with" if wants_index else "without"
            raise validate.incompatible(entry, index, f"extra.{INNER}",
                                        f"{self.kind} needs a latent lego {which} index keys")
        return lego

    # -- the codec protocol ------------------------------------------------------------------------------------
    def snapshot(self, cache: Any, *, checksums: bool = True) -> tuple[CacheEntry, list[mx.array]]:
        lego = cache.stored_lego()
        entry, arrays = _provider().for_cache(lego).snapshot(lego, checksums=checksums)
        return self._wrap(entry, cache.dtype), arrays

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        codec, inner, _ = self._unwrap(entry, index)
        codec.validate(inner, index)
        wants_index = self.adapter is DSALatentCache
        if (inner.index_head_dim is not None) is not wants_index:
            raise validate.incompatible(entry, index, "index_head_dim",
                                        f"{self.kind} {'needs' if wants_index else 'cannot have'} DSA index keys")

    def load(self, entry: CacheEntry, arrays: Sequence[mx.array], *, verify: bool = True,
             index: int | None = None) -> Any:
        self.validate(entry, index)
        codec, inner, dtype = self._unwrap(entry, index)
        lego = codec.load(inner, arrays, verify=verify, index=index)
        return self.adapter(self._check_lego(lego, entry, index), dtype)

    def _unwrap_all(self, entries: Sequence[CacheEntry]) -> tuple[Any, list[CacheEntry], mx.Dtype | None]:
        unwrapped = [self._unwrap(e, i) for i, e in enumerate(entries)]
        if not unwrapped:
            raise validate.incompatible(CacheEntry(kind=self.kind, offset=0), None, "rows", "a batch needs a row")
        codecs = {type(c).__name__ + c.kind for c, _, _ in unwrapped}
        if len(codecs) != 1:
            raise validate.incompatible(entries[0], 0, f"extra.{INNER}", "rows of one batch hold different lego kinds")
        dtype = next((d for _, _, d in unwrapped if d is not None), None)
        return unwrapped[0][0], [inner for _, inner, _ in unwrapped], dtype

    def load_batch(self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], *,
                   verify: bool = True) -> Any:
        for i, entry in enumerate(entries):
            self.validate(entry, i)
        codec, inners, dtype = self._unwrap_all(entries)
        lego = codec.load_batch(inners, arrays_per_row, verify=verify)
        return self.adapter(self._check_lego(lego, entries[0], 0), dtype)

    def batch_plan(self, entries: Sequence[CacheEntry]) -> Any:
        codec, inners, _ = self._unwrap_all(entries)
        plan_of = getattr(codec, "batch_plan", None)
        return plan_of(inners) if plan_of is not None else None

    def adopt_batch(self, entries: Sequence[CacheEntry], arrays: Sequence[mx.array]) -> Any:
        codec, inners, dtype = self._unwrap_all(entries)
        return self.adapter(self._check_lego(codec.adopt_batch(inners, arrays), entries[0], 0), dtype)

    def header_trimmable(self, entry: CacheEntry) -> bool:
        codec, inner, _ = self._unwrap(entry)
        return codec.header_trimmable(inner)

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        codec, inner, dtype = self._unwrap(entry)
        return self._wrap(codec.prefix_entry(inner, p), dtype)


LATENT_ADAPTER_CODECS = [
    LatentAdapterCodec("mlx-lm.latent", MLALatentCache),
    LatentAdapterCodec("mlx-lm.latent-dsa", DSALatentCache),
]

__all__ = ["LATENT_ADAPTER_CODECS", "LatentAdapterCodec"]
