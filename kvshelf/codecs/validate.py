"""Load-time validation: an entry against its kind's layout, then arrays against their slots.

Split from the codecs so every kind checks the same way and words failures alike: "entry 2 (latent-encoded)
field tensors[1].shape: expected [1, 5, 16], got [1, 5, 8]". A header that contradicts its kind or geometry is an
``IncompatibleFormat``; positions, pages, arrays or checksums that contradict the header are ``CorruptData``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..errors import CorruptData, IncompatibleFormat, WrongArgumentType
from . import dtypes
from .checksum import checksum
from .header import CacheEntry


# Documented maxima (docs/API.md, "Input limits"): a header asking for more is refused as ``IncompatibleFormat`` by every
# codec's ``validate`` (through ``check_slots``), before a buffer is sized from it. Generous for every model known,
# small enough that no product of them overflows or asks a 2-core host for exabytes.
MAX_POSITIONS = 2**31      # offset, floor, max_tokens, a rotating ring's max_size / keep / idx / buffer
MAX_HEADS = 2**12          # kv_heads of a key/value cache
MAX_HEAD_DIM = 2**14       # k/v head dims, kv_lora_rank, rope_head_dim, index_head_dim
MAX_BITS = 32              # bits, k_bits, v_bits
MAX_GROUP_SIZE = 2**14     # quantization group size
MAX_BLOCK_SIZE = 2**16     # a paged cache's block size
MAX_BLOCKS = 2**31         # a paged pool's num_blocks (and block table length)
MAX_TENSOR_BYTES = 2**40   # one tensor slot


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """What a kind expects of one tensor slot, derived from the entry's geometry, format and offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    token_axis: int | None


def where(entry: CacheEntry, index: int | None) -> str:
    return f"entry {index if index is not None else '?'} ({entry.kind})"


def incompatible(entry: CacheEntry, index: int | None, field: str, message: str) -> IncompatibleFormat:
    return IncompatibleFormat(f"{where(entry, index)} field {field}: {message}")


def corrupt(entry: CacheEntry, index: int | None, field: str, message: str) -> CorruptData:
    return CorruptData(f"{where(entry, index)} field {field}: {message}")


def require_entry(entry: object, what: str = "entry") -> None:
    """Codec calls take a ``CacheEntry`` (a header decoded by this package), never a lookalike."""
    if not isinstance(entry, CacheEntry):
        raise WrongArgumentType(f"{what} must be a kvshelf CacheEntry, got {type(entry).__name__}")


def _require_sequence(value: object, what: str) -> None:
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        raise WrongArgumentType(f"{what} must be a sequence, got {type(value).__name__}")


def require_entries(entries: object) -> None:
    """A sequence of ``CacheEntry`` (what ``batch_plan``/``adopt_batch`` take)."""
    _require_sequence(entries, "entries")
    for i, entry in enumerate(entries):
        require_entry(entry, f"entries[{i}]")


def require_rows(entries: object, arrays_per_row: object) -> None:
    """``load_batch``/``batch_plan`` arguments: a sequence of entries and one sequence of arrays per entry."""
    _require_sequence(entries, "entries")
    _require_sequence(arrays_per_row, "arrays_per_row")
    for i, entry in enumerate(entries):
        require_entry(entry, f"entries[{i}]")
    for i, arrays in enumerate(arrays_per_row):
        _require_sequence(arrays, f"arrays_per_row[{i}]")


def check_positions(entry: CacheEntry, index: int | None, max_tokens: int | None) -> None:
    """``0 <= minimum_reusable_offset <= offset <= max_tokens``."""
    if entry.minimum_reusable_offset > entry.offset:
        raise corrupt(
            entry, index, "minimum_reusable_offset",
            f"{entry.minimum_reusable_offset} is above the offset {entry.offset}",
        )
    if max_tokens is not None and entry.offset > max_tokens:
        raise corrupt(entry, index, "offset", f"{entry.offset} exceeds max_tokens {max_tokens}")


def check_pages(entry: CacheEntry, index: int | None) -> None:
    """Block table entries unique and below ``num_blocks``; the table has exactly the blocks the offset covers."""
    pages = entry.pages
    if pages is None:
        raise incompatible(entry, index, "pages", "missing (a paged kind needs block_size, block_table, num_blocks)")
    seen: set[int] = set()
    for i, block in enumerate(pages.block_table):
        if block >= pages.num_blocks:
            raise corrupt(entry, index, f"pages.block_table[{i}]", f"block {block} is out of range (num_blocks {pages.num_blocks})")
        if block in seen:
            raise corrupt(entry, index, f"pages.block_table[{i}]", f"block {block} appears twice")
        seen.add(block)
    needed = -(-entry.offset // pages.block_size)
    if len(pages.block_table) != needed:
        raise corrupt(
            entry, index, "pages.block_table",
            f"{len(pages.block_table)} blocks of {pages.block_size} for offset {entry.offset}; expected exactly {needed}",
        )


def check_geometry(entry: CacheEntry, index: int | None) -> None:
    """Every size the header states is within the documented maxima (before anything is allocated from it)."""
    limits = (("offset", entry.offset, MAX_POSITIONS), ("minimum_reusable_offset", entry.minimum_reusable_offset,
              MAX_POSITIONS), ("max_tokens", entry.max_tokens, MAX_POSITIONS),
              ("quantized_kv_start", entry.quantized_kv_start, MAX_POSITIONS),
              ("kv_lora_rank", entry.kv_lora_rank, MAX_HEAD_DIM), ("rope_head_dim", entry.rope_head_dim, MAX_HEAD_DIM),
              ("index_head_dim", entry.index_head_dim, MAX_HEAD_DIM), ("bits", entry.bits, MAX_BITS),
              ("k_bits", entry.k_bits, MAX_BITS), ("v_bits", entry.v_bits, MAX_BITS),
              ("group_size", entry.group_size, MAX_GROUP_SIZE))
    if entry.pages is not None:
        limits += (("pages.block_size", entry.pages.block_size, MAX_BLOCK_SIZE),
                   ("pages.num_blocks", entry.pages.num_blocks, MAX_BLOCKS),
                   ("pages.block_table", len(entry.pages.block_table), MAX_BLOCKS))
    for field, value, limit in limits:
        if value is not None and value > limit:
            raise incompatible(entry, index, field, f"{value} exceeds the supported maximum {limit}")
    for i, slot in enumerate(entry.tensors):
        if slot.nbytes > MAX_TENSOR_BYTES:
            raise incompatible(entry, index, f"tensors[{i}].nbytes", f"{slot.nbytes} exceeds the supported maximum "
                               f"{MAX_TENSOR_BYTES}")


def check_slots(entry: CacheEntry, index: int | None, specs: Sequence[SlotSpec]) -> None:
    """The entry's tensor slots are exactly ``specs`` (count, names, dtypes, shapes, token axes, byte lengths)."""
    check_geometry(entry, index)
    if len(entry.tensors) != len(specs):
        raise incompatible(
            entry, index, "tensors",
            f"expected {len(specs)} tensors ({', '.join(s.name for s in specs)}), got {len(entry.tensors)}",
        )
    for i, (slot, spec) in enumerate(zip(entry.tensors, specs)):
        field = f"tensors[{i}]"
        if slot.name != spec.name:
            raise incompatible(entry, index, f"{field}.name", f"expected {spec.name!r}, got {slot.name!r}")
        if slot.dtype != spec.dtype:
            raise incompatible(entry, index, f"{field}.dtype", f"{slot.name}: expected {spec.dtype}, got {slot.dtype}")
        if tuple(slot.shape) != spec.shape:
            raise incompatible(
                entry, index, f"{field}.shape", f"{slot.name}: expected {list(spec.shape)}, got {list(slot.shape)}"
            )
        if slot.token_axis != spec.token_axis:
            raise incompatible(
                entry, index, f"{field}.token_axis", f"{slot.name}: expected {spec.token_axis}, got {slot.token_axis}"
            )
        expected = dtypes.nbytes_of(slot.dtype, slot.shape)
        if slot.nbytes != expected:
            raise corrupt(entry, index, f"{field}.nbytes", f"{slot.name}: expected {expected}, got {slot.nbytes}")
        if slot.checksum and len(slot.checksum) != 32:
            raise corrupt(entry, index, f"{field}.checksum", f"{slot.name}: not an xxh3-128 hex digest ({slot.checksum!r})")


def check_arrays(entry: CacheEntry, index: int | None, arrays: Sequence[mx.array], verify: bool) -> None:
    """Every array matches its slot's dtype and shape, and (when verifying) its checksum."""
    _require_sequence(arrays, "arrays")
    if len(arrays) != len(entry.tensors):
        raise corrupt(entry, index, "tensors", f"{len(entry.tensors)} slots but {len(arrays)} arrays were given")
    for i, (slot, array) in enumerate(zip(entry.tensors, arrays)):
        field = f"tensors[{i}]"
        if not isinstance(array, mx.array):
            raise corrupt(entry, index, field, f"{slot.name}: expected an mlx array, got {type(array).__name__}")
        if array.dtype != dtypes.mlx_dtype(slot.dtype) or tuple(array.shape) != tuple(slot.shape):
            raise corrupt(
                entry, index, field,
                f"{slot.name}: slot says {slot.dtype} {list(slot.shape)}, array is {str(array.dtype).removeprefix('mlx.core.')} "
                f"{list(array.shape)}",
            )
        if verify and slot.checksum:
            got = checksum(array)
            if got != slot.checksum:
                raise corrupt(entry, index, f"{field}.checksum", f"{slot.name}: stored {slot.checksum}, computed {got}")


__all__ = ["MAX_POSITIONS", "MAX_HEADS", "MAX_HEAD_DIM", "MAX_BITS", "MAX_GROUP_SIZE", "MAX_BLOCK_SIZE", "MAX_BLOCKS",
           "MAX_TENSOR_BYTES", "check_geometry", "require_entry", "require_entries", "require_rows", "SlotSpec", "where", "incompatible", "corrupt", "check_positions", "check_pages", "check_slots", "check_arrays"]
