"""Fuzzing the header decoders: whatever the bytes, only KvShelfError subclasses come out."""

from __future__ import annotations

import os
import tempfile

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshelf.codecs import (
    CacheEntry,
    PageLayout,
    SnapshotHeader,
    TensorSlot,
    decode_entry,
    decode_header,
    decode_header_json,
    default_provider,
    encode_header,
    encode_header_json,
    read_header,
)
from kvshelf.errors import KvShelfError

VALID = SnapshotHeader(
    provider="kvshelf-cache-v1",
    created_at=12.0,
    model_id="m",
    tokens=[1, 2, 3],
    caches=[
        CacheEntry(
            kind="latent-paged",
            offset=3,
            kv_lora_rank=32,
            rope_head_dim=32,
            pages=PageLayout(block_size=2, block_table=[0, 1], num_blocks=2),
            tensors=[TensorSlot(name="latent.pool", dtype="float32", shape=[2, 2, 32], token_axis=None, nbytes=512)],
        )
    ],
)
VALID_JSON = encode_header_json(VALID)
VALID_MSGPACK = encode_header(VALID)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decodes_or_raises_ours(decode, data) -> None:
    try:
        result = decode(data)
    except KvShelfError:
        return
    # Whatever decodes is a fully typed header; validating it against the codecs raises only our errors too.
    if isinstance(result, SnapshotHeader):
        try:
            default_provider.validate_header(result)
        except KvShelfError:
            pass


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, value) edits: 0 replace a byte, 1 insert a byte, 2 delete a byte."""
    buf = bytearray(data)
    for kind, position, value in edits:
        if not buf:
            buf.append(value)
            continue
        at = position % len(buf)
        if kind == 0:
            buf[at] = value
        elif kind == 1:
            buf.insert(at, value)
        else:
            del buf[at]
    return bytes(buf)


edits = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_msgpack(data):
    decodes_or_raises_ours(decode_header, data)
    decodes_or_raises_ours(decode_entry, data)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_json(data):
    decodes_or_raises_ours(decode_header_json, data)


@FUZZ
@given(edits)
def test_mutated_valid_json_header(changes):
    decodes_or_raises_ours(decode_header_json, mutate(VALID_JSON, changes))


@FUZZ
@given(edits)
def test_mutated_valid_msgpack_header(changes):
    decodes_or_raises_ours(decode_header, mutate(VALID_MSGPACK, changes))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


VALID_PATHS = [p for p in _paths(msgspec.json.decode(VALID_JSON)) if p]


@FUZZ
@given(st.sampled_from(VALID_PATHS), json_values)
def test_valid_header_with_one_value_replaced(path, value):
    raw = msgspec.json.decode(VALID_JSON)
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    data = msgspec.json.encode(raw)
    decodes_or_raises_ours(decode_header_json, data)
    decodes_or_raises_ours(decode_header, msgspec.msgpack.encode(raw))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | edits.map(lambda e: mutate(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"__metadata__":{}}', e)))
def test_read_header_of_arbitrary_file(data):
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    try:
        os.write(fd, data)
        os.close(fd)
        try:
            read_header(path)
        except KvShelfError:
            pass
    finally:
        os.unlink(path)


def _small_snapshot_bytes() -> bytes:
    import mlx.core as mx

    from kvshelf.codecs import save_snapshot
    from kvshelf.latent_legos import AffineFormat, LatentGeometry, PagedLatentCache

    cache = PagedLatentCache(LatentGeometry(32, 32, 32), AffineFormat(4, 32), 2)
    cache.append_latent(mx.ones((1, 3, 32)), mx.zeros((1, 3, 32)), mx.full((1, 3, 32), 2.0))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.safetensors")
        save_snapshot(path, [1, 2, 3], [cache])
        with open(path, "rb") as f:
            return f.read()


SNAPSHOT = _small_snapshot_bytes()
SNAPSHOT_HEADER_END = 8 + int.from_bytes(SNAPSHOT[:8], "little")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, SNAPSHOT_HEADER_END + 64), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_snapshot_file_loads_or_raises_ours(changes):
    from kvshelf.codecs import load_snapshot

    fd, path = tempfile.mkstemp(suffix=".safetensors")
    try:
        os.write(fd, mutate(SNAPSHOT, changes))
        os.close(fd)
        try:
            load_snapshot(path)
        except KvShelfError:
            pass
    finally:
        os.unlink(path)
