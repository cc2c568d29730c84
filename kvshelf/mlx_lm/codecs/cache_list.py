"""mlx-lm's ``CacheList`` (one layer made of several caches: glm_moe_dsa's latent + indexer keys, falcon_h1's
recurrent + attention, any nesting) <-> one ``mlx-lm.list`` entry.

Each child is persisted by whichever codec of the default provider takes it (mlx-lm's classes, kvshelf's legos,
another ``CacheList``), and its entry is folded into the list's: child k's tensors are slots named ``<k>.<slot>``
(token axes kept, so the store chunks and cuts them like any other), its header fields ride in ``extra`` as
``<k>.@<field>`` and its own ``extra`` as ``<k>.<key>`` (a nested list simply prefixes again). Every child holds the
list's positions; the floor is the highest child floor; a prefix exists iff every child has one (mlx-lm's
``CacheList.is_trimmable``) and cuts every child.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import CacheList

from ...codecs import validate
from ...codecs.batch_plan import BatchPlan, BatchTensor, RowSource
from ...codecs.header import CacheEntry, TensorSlot
from ...codecs.kinds.latent_common import check_prefix
from ...errors import InvalidCacheState, KvShelfError
from .base import MlxCodec

_FIELDS = ("kind", "offset", "minimum_reusable_offset", "kv_lora_rank", "rope_head_dim", "index_head_dim",
           "max_tokens", "bits", "group_size", "k_bits", "v_bits", "quantized_kv_start", "shadow")
_DEFAULT = CacheEntry(kind="-", offset=0)


def _provider():
    from ...codecs import default_provider

    return default_provider


def fold(children: Sequence[CacheEntry]) -> tuple[list[TensorSlot], dict[str, Any]]:
    """The list entry's slots and extra for these child entries."""
    slots: list[TensorSlot] = []
    extra: dict[str, Any] = {"children": len(children)}
    for k, child in enumerate(children):
        if child.pages is not None:
            raise InvalidCacheState(f"CacheList child {k} ({child.kind}) is paged; a paged child is not supported")
        for field in _FIELDS:
            value = getattr(child, field)
            if field in ("kind", "offset") or value != getattr(_DEFAULT, field):
                extra[f"{k}.@{field}"] = value
        extra[f"{k}.@tensors"] = len(child.tensors)
        for key, value in child.extra.items():
            extra[f"{k}.{key}"] = value
        slots += [msgspec.structs.replace(s, name=f"{k}.{s.name}") for s in child.tensors]
    return slots, extra


def unfold(entry: CacheEntry, index: int | None) -> list[CacheEntry]:
    """The child entries folded into a list entry (``IncompatibleFormat`` when the folding is malformed)."""
    count = entry.extra.get("children")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 4096:
        raise validate.incompatible(entry, index, "extra.children", f"expected a child count in [1, 4096], got {count!r}")
    fields: list[dict[str, Any]] = [{} for _ in range(count)]
    extras: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in entry.extra.items():
        if key == "children":
            continue
        head, _, rest = key.partition(".")
        if not head.isdigit() or int(head) >= count or not rest:
            raise validate.incompatible(entry, index, f"extra.{key}", "names no child of this list")
        k = int(head)
        if rest.startswith("@"):
            fields[k][rest[1:]] = value
        else:
            extras[k][rest] = value
    children, start = [], 0
    for k in range(count):
        own = fields[k]
        n = own.pop("tensors", None)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or start + n > len(entry.tensors):
            raise validate.incompatible(entry, index, f"extra.{k}.@tensors", f"bad tensor count {n!r}")
        unknown = set(own) - set(_FIELDS)
        if unknown or "kind" not in own or "offset" not in own:
            raise validate.incompatible(entry, index, f"extra.{k}", f"child fields {sorted(own)} are malformed")
        prefix = f"{k}."
        slots = []
        for slot in entry.tensors[start:start + n]:
            if not slot.name.startswith(prefix):
                raise validate.incompatible(entry, index, "tensors", f"slot {slot.name!r} is not child {k}'s")
            slots.append(msgspec.structs.replace(slot, name=slot.name[len(prefix):]))
        start += n
        try:
            children.append(msgspec.convert({**own, "tensors": [msgspec.to_builtins(s) for s in slots],
                                             "extra": extras[k]}, CacheEntry))
        except msgspec.ValidationError as exc:
            raise validate.incompatible(entry, index, f"extra.{k}", f"child entry does not decode: {exc}") from None
    if start != len(entry.tensors):
        raise validate.incompatible(entry, index, "tensors", f"{len(entry.tensors) - start} slots belong to no child")
    return children


def _in_child(entry: CacheEntry, index: int | None, k: int, exc: KvShelfError) -> KvShelfError:
    return type(exc)(f"{validate.where(entry, index)} child {k}: {exc}")


class ListCodec(MlxCodec):
    """``CacheList`` (see the module docstring)."""

    kind = "mlx-lm.list"
    cache_type = CacheList
    takes_length = True

    def snapshot(self, cache: CacheList, *, checksums: bool = True, length: int | None = None
                 ) -> tuple[CacheEntry, list[mx.array]]:
        provider = _provider()
        children, arrays = [], []
        for k, child in enumerate(cache.caches):
            try:
                entry, arrs = provider.snapshot(child, checksums=checksums, length=length)
            except KvShelfError as exc:
                raise type(exc)(f"CacheList child {k}: {exc}") from None
            children.append(entry)
            arrays += arrs
        if not children:
            raise InvalidCacheState("an empty CacheList holds nothing to persist")
        offsets = {c.offset for c in children}
        if len(offsets) != 1:
            raise InvalidCacheState(f"CacheList children hold different position counts {sorted(offsets)}")
        slots, extra = fold(children)
        entry = CacheEntry(kind=self.kind, offset=offsets.pop(), tensors=slots, extra=extra,
                           minimum_reusable_offset=max(c.minimum_reusable_offset for c in children))
        self.validate(entry)
        return entry, arrays

    def children(self, entry: CacheEntry, index: int | None = None) -> list[tuple[Any, CacheEntry]]:
        """``(codec, child entry)`` per child, each validated."""
        provider = _provider()
        out = []
        for k, child in enumerate(unfold(entry, index)):
            if child.offset != entry.offset:
                raise validate.corrupt(entry, index, f"extra.{k}.@offset",
                                       f"child holds {child.offset} positions, the list {entry.offset}")
            try:
                codec = provider.for_entry(child)
                codec.validate(child, k)
            except KvShelfError as exc:
                raise _in_child(entry, index, k, exc) from None
            out.append((codec, child))
        return out

    def validate(self, entry: CacheEntry, index: int | None = None) -> None:
        if entry.kind != self.kind:
            raise validate.incompatible(entry, index, "kind", f"expected {self.kind!r}")
        for field in _FIELDS[3:]:
            if getattr(entry, field) != getattr(_DEFAULT, field) or entry.pages is not None:
                raise validate.incompatible(entry, index, field, "a list keeps its children's fields in extra")
        children = self.children(entry, index)
        floor = max(c.minimum_reusable_offset for _, c in children)
        if entry.minimum_reusable_offset != floor:
            raise validate.corrupt(entry, index, "minimum_reusable_offset", f"expected the children's {floor}")

    def _build(self, entry: CacheEntry, arrays: list[mx.array], index: int | None) -> CacheList:
        caches, start = [], 0
        for k, (codec, child) in enumerate(self.children(entry, index)):
            n = len(child.tensors)
            try:
                caches.append(codec.load(child, arrays[start:start + n], verify=False, index=k))
            except KvShelfError as exc:
                raise _in_child(entry, index, k, exc) from None
            start += n
        return CacheList(*caches)

    # -- the direct batch path: when every child has one (glm_moe_dsa's two KVCaches), the children's plans side
    # by side, each child's slots shifted to where they sit in the row's list entry ---------------------------------
    def _child_rows(self, entries: list[CacheEntry]) -> list[tuple[Any, list[CacheEntry]]]:
        per_row = [self.children(e, i) for i, e in enumerate(entries)]
        if len({len(r) for r in per_row}) != 1:
            raise InvalidCacheState(f"{self.kind}: rows have different child counts; mlx-lm's merge needs one layout")
        out = []
        for k in range(len(per_row[0])):
            kinds = sorted({r[k][1].kind for r in per_row})
            if len(kinds) != 1:
                raise InvalidCacheState(f"{self.kind}: child {k} is of kinds {kinds} across the rows")
            out.append((per_row[0][k][0], [r[k][1] for r in per_row]))
        return out

    def batch_plan(self, entries: Sequence[CacheEntry]) -> BatchPlan | None:
        entries = list(entries)
        self._check_batch(entries)
        tensors: list[BatchTensor] = []
        bases = [0] * len(entries)
        for k, (codec, rows) in enumerate(self._child_rows(entries)):
            plan = codec.batch_plan(rows) if isinstance(codec, MlxCodec) else None
            if plan is None:
                return None
            for t in plan.tensors:
                moved = tuple(RowSource(None if s.slot is None else s.slot + bases[b], s.start)
                              for b, s in enumerate(t.rows))
                tensors.append(BatchTensor(f"{k}.{t.name}", t.dtype, t.shape, t.token_axis, moved))
            bases = [base + len(row.tensors) for base, row in zip(bases, rows)]
        return BatchPlan(tuple(tensors))

    def adopt_batch(self, entries: Sequence[CacheEntry], arrays: Sequence[mx.array]) -> CacheList:
        arrays, start, children = list(arrays), 0, []
        for codec, rows in self._child_rows(list(entries)):
            n = len(codec.batch_plan(rows).tensors)
            children.append(codec.adopt_batch(rows, arrays[start:start + n]))
            start += n
        cache = CacheList()
        cache.caches = tuple(children)  # as CacheList.merge builds it
        return cache

    def header_trimmable(self, entry: CacheEntry) -> bool:
        return all(codec.header_trimmable(child) for codec, child in self.children(entry))

    def prefix_entry(self, entry: CacheEntry, p: int) -> CacheEntry:
        check_prefix(entry, p)
        cut = [codec.prefix_entry(child, p) for codec, child in self.children(entry)]
        slots, extra = fold(cut)
        return msgspec.structs.replace(entry, offset=p, tensors=slots, extra=extra,
                                       minimum_reusable_offset=max(c.minimum_reusable_offset for c in cut))


LIST_CODECS = (ListCodec(),)

__all__ = ["LIST_CODECS", "ListCodec", "fold", "unfold"]
