"""The portable single-file snapshot: one safetensors file whose metadata carries the msgspec header.

Written with MLX's own safetensors writer (it handles bfloat16), atomically: a 0600 temporary file in the target
directory, fsync, rename, fsync of the directory, so a reader sees the old file or the whole new one. Read back
with our own small parser of the safetensors framing, so the header is checked (its own checksum, provider id,
kinds, layouts, identity) and every tensor's place in the file is bounds-checked before a tensor byte is read;
each tensor's checksum is verified on the raw bytes before MLX sees them. The file still opens in ordinary
safetensors tools: tensors are named ``<cache index>.<slot name>``.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import mlx.core as mx
import msgspec
import numpy as np

from ..errors import CorruptData, InvalidCacheState, KvShelfError, StoreFull, file_error
from . import dtypes
from .checksum import checksum_bytes
from .codec import CodecProvider
from .header import SnapshotHeader, decode_header_json, encode_header_json
from .provider import default_provider
from .snapshot_args import (
    check_identity,
    identity_fields,
    normalize_tokens,
    open_regular,
    snapshot_path,
)

HEADER_KEY = "kvshelf.header"
HEADER_CHECKSUM_KEY = "kvshelf.header_xxh3"
FORMAT_KEY = "format"
FORMAT_VALUE = "kvshelf-snapshot"
MAX_HEADER_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Snapshot:
    """What ``load_snapshot`` returns: the tokens the caches encode, the caches in layer order, the header."""

    tokens: list[int]
    caches: list[Any]
    header: SnapshotHeader


# ----------------------------------------------------------------------------------------------------------------
# writing


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in ``directory`` durable (every layer that publishes files uses this one)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _build(tokens: Any, caches: Sequence[Any], identity: Any, provider: CodecProvider):
    tokens = normalize_tokens(tokens)
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence):
        raise InvalidCacheState(f"caches must be a sequence of caches (got {type(caches).__name__})")
    entries, tensors = [], {}
    for index, cache in enumerate(caches):
        entry, arrays = provider.snapshot(cache, length=len(tokens))
        if entry.offset != len(tokens):
            raise InvalidCacheState(
                f"cache {index} ({entry.kind}) holds {entry.offset} positions but {len(tokens)} tokens were given; "
                "a snapshot's caches must encode exactly its tokens"
            )
        entries.append(entry)
        for slot, array in zip(entry.tensors, arrays):
            tensors[f"{index}.{slot.name}"] = array
    header = SnapshotHeader(
        provider=provider.id, created_at=time.time(), tokens=tokens, caches=entries, **identity_fields(identity)
    )
    return header, tensors


def save_snapshot(
    path: str | os.PathLike[str],
    tokens: Any,
    caches: Sequence[Any],
    identity: Any = None,
    *,
    provider: CodecProvider = default_provider,
    read_back: bool = False,
) -> SnapshotHeader:
    """Write ``caches`` (serial rows, layer order) and the ``tokens`` they encode to one safetensors file.

    ``identity``: None, a mapping or an object with ``model_id``, ``config_fingerprint``, ``tokenizer_hash``,
    ``namespace``. Atomic (old file or new file, never a mix); mode 0600. Returns the header written.
    ``read_back``: the written file is loaded and verified (``load_snapshot``) before it takes ``path``'s name, so
    an export is reported done only once it reads back; a failure leaves nothing under ``path``.
    """
    target = snapshot_path(path)
    header, tensors = _build(tokens, caches, identity, provider)
    text = encode_header_json(header).decode("utf-8")
    metadata = {FORMAT_KEY: FORMAT_VALUE, HEADER_KEY: text, HEADER_CHECKSUM_KEY: checksum_bytes(text.encode("utf-8"))}
    directory = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp.safetensors", dir=directory)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull(f"no space to write snapshot {target}: {exc}") from exc
        raise file_error(exc, f"cannot write snapshot {target}") from None
    os.close(fd)  # mkstemp made it 0600; MLX truncates and writes it in place
    try:
        mx.save_safetensors(tmp, tensors, metadata=metadata)
        os.chmod(tmp, 0o600)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        if read_back:
            try:
                load_snapshot(tmp, verify=True, provider=provider)
            except KvShelfError as exc:
                raise CorruptData(f"{target}: the file written does not read back, so it was not kept: {exc}") from exc
        os.replace(tmp, target)
        fsync_dir(directory)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull(f"no space to write snapshot {target}: {exc}") from exc
        if isinstance(exc, OSError):
            raise file_error(exc, f"cannot write snapshot {target}") from None
        if isinstance(exc, RuntimeError):  # MLX's writer reports I/O failures as RuntimeError
            if _nearly_full(directory):
                raise StoreFull(f"no space to write snapshot {target}: {exc}") from exc
            raise file_error(OSError(errno.EIO, str(exc), str(target)), f"cannot write snapshot {target}") from None
        raise
    return header


def _nearly_full(directory: Path, reserve: int = 1 << 20) -> bool:
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < reserve


# ----------------------------------------------------------------------------------------------------------------
# reading


class _TableTensor(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0, le=2**40)]]
    data_offsets: tuple[Annotated[int, msgspec.Meta(ge=0, le=2**62)], Annotated[int, msgspec.Meta(ge=0, le=2**62)]]


@dataclass(frozen=True)
class _Layout:
    header: SnapshotHeader
    table: dict[str, _TableTensor]
    data_start: int
    data_size: int


_RAW_TABLE = msgspec.json.Decoder(dict[str, msgspec.Raw])
_TABLE_TENSOR = msgspec.json.Decoder(_TableTensor)
_METADATA = msgspec.json.Decoder(dict[str, str] | None)


def _read_layout(handle: BinaryIO, path: Path) -> _Layout:
    size = os.fstat(handle.fileno()).st_size
    prefix = _read(handle, 8, path)
    if len(prefix) != 8:
        raise CorruptData(f"{path}: truncated ({size} bytes; a safetensors file starts with an 8-byte header length)")
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES or length > size - 8:
        raise CorruptData(f"{path}: header length {length} does not fit (file has {size} bytes; limit {MAX_HEADER_BYTES})")
    raw = _read(handle, length, path)
    if len(raw) != length:
        raise CorruptData(f"{path}: truncated inside the safetensors header")
    try:
        parts = _RAW_TABLE.decode(raw)
        metadata = (_METADATA.decode(parts.pop("__metadata__")) if "__metadata__" in parts else None) or {}
        table = {name: _TABLE_TENSOR.decode(value) for name, value in parts.items()}
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptData(f"{path}: safetensors header does not decode ({exc})") from None
    text = metadata.get(HEADER_KEY)
    if text is None:
        raise CorruptData(f"{path}: not a kvshelf snapshot (no {HEADER_KEY!r} in the safetensors metadata)")
    stored = metadata.get(HEADER_CHECKSUM_KEY)
    encoded = text.encode("utf-8", "surrogatepass")
    computed = checksum_bytes(encoded)
    if stored != computed:
        raise CorruptData(f"{path}: header checksum mismatch (stored {stored!r}, computed {computed})")
    header = decode_header_json(encoded)
    return _Layout(header, table, 8 + length, size - 8 - length)


def _read(handle: BinaryIO, n: int, path: Path) -> bytes:
    try:
        return handle.read(n)
    except OSError as exc:
        raise file_error(exc, f"cannot read snapshot {path}") from None


def read_header(path: str | os.PathLike[str]) -> SnapshotHeader:
    """The snapshot's header alone (no tensor byte is read); a damaged header is ``CorruptData``."""
    target = snapshot_path(path)
    with open_regular(target) as handle:
        return _read_layout(handle, target).header


def _check_places(layout: _Layout, path: Path) -> None:
    """Every tensor of the file's table lies inside the data section and no two overlap (checked against the file
    size before any tensor byte is read: a crafted table cannot alias one tensor's bytes as another's)."""
    spans = []
    for name, found in layout.table.items():
        begin, end = found.data_offsets
        if begin > end:
            raise CorruptData(f"{path}: tensor {name} has data_offsets [{begin}, {end}) (begin after end)")
        if end > layout.data_size:
            raise CorruptData(f"{path}: tensor {name} ends at {end}, outside the {layout.data_size} data bytes "
                              f"(truncated or crafted file)")
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in pairwise(spans):
        if b1 < e0:
            raise CorruptData(f"{path}: tensors {n0} and {n1} overlap in the file (bytes [{b1}, {e0}))")


def _check_table(layout: _Layout, path: Path) -> list[list[tuple[str, int, int]]]:
    """Each slot's place in the file: present, same dtype and shape, inside the data, nothing extra."""
    header, table = layout.header, layout.table
    places: list[list[tuple[str, int, int]]] = []
    expected_names = set()
    for index, entry in enumerate(header.caches):
        row = []
        for i, slot in enumerate(entry.tensors):
            name = f"{index}.{slot.name}"
            expected_names.add(name)
            where = f"{path}: entry {index} ({entry.kind}) field tensors[{i}] ({name})"
            found = table.get(name)
            if found is None:
                raise CorruptData(f"{where}: missing from the file's tensor table")
            if found.dtype != dtypes.safetensors_code(slot.dtype) or list(found.shape) != list(slot.shape):
                raise CorruptData(
                    f"{where}: header says {slot.dtype} {list(slot.shape)}, file has {found.dtype} {list(found.shape)}"
                )
            begin, end = found.data_offsets
            if end - begin != slot.nbytes or begin > end:
                raise CorruptData(f"{where}: file holds {end - begin} bytes, header says {slot.nbytes}")
            if end > layout.data_size:
                raise CorruptData(f"{where}: truncated file (tensor ends at {end}, data has {layout.data_size} bytes)")
            row.append((slot.dtype, begin, end))
        places.append(row)
    extra = sorted(set(table) - expected_names)
    if extra:
        raise CorruptData(f"{path}: tensors {extra[:5]} are not named by the header")
    _check_places(layout, path)
    return places


def _read_tensor(handle: BinaryIO, layout: _Layout, begin: int, end: int) -> np.ndarray:
    """The tensor's raw bytes, read straight into a fresh host buffer."""
    host = np.empty(end - begin, dtype=np.uint8)
    try:
        handle.seek(layout.data_start + begin)
        got = handle.readinto(memoryview(host)) if end > begin else 0
    except OSError as exc:
        raise file_error(exc, "cannot read snapshot tensor bytes") from None
    if got != end - begin:
        raise CorruptData(f"truncated file: expected {end - begin} tensor bytes, read {got}")
    return host


def _to_mlx(host: np.ndarray, dtype: str, shape: list[int]) -> mx.array:
    values = host.view(dtypes.numpy_dtype(dtype)).reshape(shape)
    array = mx.array(values)
    if dtype == "bfloat16":
        array = array.view(mx.bfloat16)
    return array


def load_snapshot(
    path: str | os.PathLike[str],
    expect: Any = None,
    verify: bool = True,
    *,
    provider: CodecProvider = default_provider,
) -> Snapshot:
    """Read a snapshot file back into serial caches, checking everything before it is trusted.

    Order: header checksum and schema, provider id, kinds and layouts, ``expect`` identity fields (None, a mapping
    or an object; every field given must match), each tensor's place in the file, then per tensor its checksum
    (``verify``) before the codec builds the cache. Any failure raises and returns nothing.
    """
    target = snapshot_path(path)
    with open_regular(target) as handle:
        layout = _read_layout(handle, target)
        header = layout.header
        provider.validate_header(header)
        check_identity(header, expect)
        for index, entry in enumerate(header.caches):
            if entry.offset != len(header.tokens):
                raise CorruptData(
                    f"{target}: entry {index} ({entry.kind}) field offset: {entry.offset}, "
                    f"but the header has {len(header.tokens)} tokens"
                )
        places = _check_table(layout, target)
        caches = []
        for index, (entry, row) in enumerate(zip(header.caches, places)):
            arrays = []
            for i, (slot, (dtype, begin, end)) in enumerate(zip(entry.tensors, row)):
                if verify and not slot.checksum:
                    raise CorruptData(f"{target}: entry {index} ({entry.kind}) field tensors[{i}].checksum: "
                                      f"{slot.name} has no checksum (pass verify=False to load unverified data)")
                host = _read_tensor(handle, layout, begin, end)
                if verify:
                    computed = checksum_bytes(memoryview(host))
                    if computed != slot.checksum:
                        raise CorruptData(
                            f"{target}: entry {index} ({entry.kind}) field tensors[{i}].checksum: {slot.name}: "
                            f"stored {slot.checksum}, computed {computed}"
                        )
                arrays.append(_to_mlx(host, dtype, slot.shape))
            caches.append(provider.load(entry, arrays, verify=False, index=index))
    return Snapshot(tokens=list(header.tokens), caches=caches, header=header)


__all__ = ["Snapshot", "save_snapshot", "load_snapshot", "read_header", "normalize_tokens", "identity_fields", "check_identity"]
