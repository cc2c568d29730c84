"""The codec seam: a ``Codec`` per cache kind, and a versioned ``CodecProvider`` that picks them.

A file or store names only the provider id and each entry's kind; the codecs are code. The id is checked before
any tensor is read, so a snapshot written under other codecs is refused instead of misread. New cache kinds join
by building a provider with more codecs (``provider.extended(...)``); the store never changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from ..errors import IncompatibleFormat, WrongArgumentType
from .header import CacheEntry, SnapshotHeader


@runtime_checkable
class Codec(Protocol):
    """Turns one kind of cache into ``(CacheEntry, arrays)`` and back, exactly."""

    kind: str

    def matches(self, cache: Any) -> bool:
        """Whether this codec persists ``cache`` (the provider requires exactly one match)."""
        ...

    def snapshot(self, cache: Any, *, checksums: bool = True) -> tuple[CacheEntry, list[mx.array]]:
        """Serial state only: the entry and owned arrays in slot order.

        ``checksums=False`` leaves every slot's checksum empty: the store hashes whole chunks itself, and skipping
        the per-tensor pass is what lets ``save_async`` return without reading the tensors."""
        ...

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        """Header-only checks of an entry against its kind, before any tensor is read."""
        ...

    def load(self, entry: CacheEntry, arrays: Sequence[mx.array], *, verify: bool = True, index: int | None = None) -> Any:
        """A serial cache rebuilt from the entry and its arrays (validated first; checksums "" are skipped)."""
        ...

    def load_batch(
        self, entries: Sequence[CacheEntry], arrays_per_row: Sequence[Sequence[mx.array]], *, verify: bool = True
    ) -> Any:
        """One batched cache holding every row, equal to loading each and ``merge_rows``."""
        ...

    def header_trimmable(self, entry: CacheEntry) -> bool:
        """Whether a prefix of the entry is a valid state (so a shorter prompt may reuse it)."""
        ...

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        """The entry of the same cache cut to its first ``p`` positions (checksums cleared)."""
        ...


def _signature(cache: Any) -> str:
    try:
        return str(cache.signature())
    except Exception:  # a foreign object: its type is the best description we have
        return type(cache).__name__


class CodecProvider:
    """A versioned table of codecs: ``for_cache`` by match, ``for_entry`` by kind."""

    def __init__(self, id: str, codecs: Iterable[Codec]) -> None:
        if not isinstance(id, str) or not id.strip():
            raise IncompatibleFormat(f"a codec provider id must be a non-blank string (got {id!r})")
        self.id = id
        self.codecs: tuple[Codec, ...] = tuple(codecs)
        self._by_kind: dict[str, Codec] = {}
        for codec in self.codecs:
            if codec.kind in self._by_kind:
                raise IncompatibleFormat(f"codec provider {id!r}: two codecs claim kind {codec.kind!r}")
            self._by_kind[codec.kind] = codec

    def __repr__(self) -> str:
        return f"CodecProvider({self.id!r}, kinds={sorted(self._by_kind)})"

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._by_kind)

    def extended(self, id: str, codecs: Iterable[Codec]) -> CodecProvider:
        """A new provider (new id: files name what they need) with these codecs added to this one's."""
        return CodecProvider(id, [*self.codecs, *codecs])

    def for_cache(self, cache: Any) -> Codec:
        """The one codec that persists ``cache``; none or several is an ``IncompatibleFormat``."""
        found = [codec for codec in self.codecs if codec.matches(cache)]
        if len(found) != 1:
            kinds = f" ({', '.join(codec.kind for codec in found)})" if found else ""
            raise IncompatibleFormat(
                f"codec provider {self.id!r}: {len(found)} matches for {_signature(cache)}{kinds}; expected exactly one"
            )
        return found[0]

    def for_entry(self, entry: CacheEntry | str) -> Codec:
        """The codec of an entry's kind; an unknown kind is an ``IncompatibleFormat``."""
        if not isinstance(entry, (str, CacheEntry)):
            raise WrongArgumentType(f"for_entry takes a CacheEntry or a kind name, got {type(entry).__name__}")
        kind = entry if isinstance(entry, str) else entry.kind
        try:
            return self._by_kind[kind]
        except KeyError:
            raise IncompatibleFormat(
                f"codec provider {self.id!r} has no codec for cache kind {kind!r} (known: {', '.join(sorted(self._by_kind))})"
            ) from None

    def check_provider(self, id: str) -> None:
        """Refuse state written under another provider id (before any tensor is read)."""
        if id != self.id:
            raise IncompatibleFormat(f"snapshot was written by codec provider {id!r}; this reader is {self.id!r}")

    def validate_header(self, header: SnapshotHeader) -> None:
        """Provider id, then every entry's kind and layout: everything checkable without tensor bytes."""
        if not isinstance(header, SnapshotHeader):
            raise WrongArgumentType(f"validate_header takes a SnapshotHeader, got {type(header).__name__}")
        self.check_provider(header.provider)
        for index, entry in enumerate(header.caches):
            self.for_entry(entry).validate(entry, index)

    def snapshot(self, cache: Any, *, checksums: bool = True, length: int | None = None
                 ) -> tuple[CacheEntry, list[mx.array]]:
        """The cache's entry and arrays. ``length`` is the number of tokens the caller says the cache encodes:
        codecs of caches that do not count positions themselves (``takes_length = True``, e.g. mlx-lm's
        ``ArraysCache``) record it as the offset; every other codec records its own count (callers compare)."""
        codec = self.for_cache(cache)
        if getattr(codec, "takes_length", False):
            return codec.snapshot(cache, checksums=checksums, length=length)
        return codec.snapshot(cache, checksums=checksums)

    def load(self, entry: CacheEntry, arrays: Sequence[mx.array], *, verify: bool = True, index: int | None = None) -> Any:
        return self.for_entry(entry).load(entry, arrays, verify=verify, index=index)


__all__ = ["Codec", "CodecProvider"]
