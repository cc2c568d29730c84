"""The msgspec header schema: round trips, type validation, versioning and bounds."""

from __future__ import annotations

import msgspec
import pytest

from kvshelf.codecs import (
    FORMAT_VERSION,
    CacheEntry,
    PageLayout,
    SnapshotHeader,
    TensorSlot,
    decode_entry,
    decode_header,
    decode_header_json,
    encode_entry,
    encode_header,
    encode_header_json,
)
from kvshelf.errors import CorruptData, IncompatibleFormat


def sample_header() -> SnapshotHeader:
    slot = TensorSlot(name="latent", dtype="float32", shape=[1, 3, 64], token_axis=1, nbytes=768, checksum="ab" * 16)
    pool = TensorSlot(name="latent.pool", dtype="float32", shape=[2, 4, 64], token_axis=None, nbytes=2048)
    return SnapshotHeader(
        provider="kvshelf-cache-v1",
        created_at=1700000000.5,
        model_id="glm",
        config_fingerprint="cfg",
        tokenizer_hash="tok",
        namespace="ns",
        tokens=[5, 6, 7],
        caches=[
            CacheEntry(kind="mla", offset=3, kv_lora_rank=64, rope_head_dim=32, tensors=[slot]),
            CacheEntry(
                kind="latent-paged",
                offset=3,
                kv_lora_rank=64,
                rope_head_dim=32,
                pages=PageLayout(block_size=4, block_table=[1], num_blocks=2),
                tensors=[pool],
                extra={"note": "x", "n": 3},
            ),
        ],
    )


def test_msgpack_round_trip_is_exact():
    header = sample_header()
    assert decode_header(encode_header(header)) == header


def test_json_round_trip_is_exact():
    header = sample_header()
    text = encode_header_json(header)
    assert decode_header_json(text) == header
    assert decode_header_json(text.decode()) == header


def test_entry_round_trip_is_exact():
    entry = sample_header().caches[1]
    assert decode_entry(encode_entry(entry)) == entry


def test_structs_are_frozen():
    header = sample_header()
    with pytest.raises(AttributeError):
        header.provider = "other"  # type: ignore[misc]


def test_token_axis_is_recorded_per_slot():
    header = decode_header(encode_header(sample_header()))
    assert header.caches[0].tensors[0].token_axis == 1
    assert header.caches[1].tensors[0].token_axis is None


def test_other_version_is_incompatible_not_corrupt():
    raw = msgspec.json.decode(encode_header_json(sample_header()))
    raw["format_version"] = FORMAT_VERSION + 1
    raw["something_new"] = {"a": 1}
    with pytest.raises(IncompatibleFormat, match=r"format_version 2 is not supported \(expected 1\)"):
        decode_header_json(msgspec.json.encode(raw))
    with pytest.raises(IncompatibleFormat, match="format_version 2"):
        decode_header(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("tokens", 0), -1, r"Expected `int` >= 0 - at `\$.tokens\[0\]`"),
        (("caches", 0, "offset"), "3", r"Expected `int`, got `str` - at `\$.caches\[0\].offset`"),
        (("caches", 0, "tensors", 0, "nbytes"), -5, r"at `\$.caches\[0\].tensors\[0\].nbytes`"),
        (("caches", 0, "tensors", 0, "checksum"), "XYZ", r"at `\$.caches\[0\].tensors\[0\].checksum`"),
        (("caches", 0, "tensors", 0, "shape", 1), 2**41, r"at `\$.caches\[0\].tensors\[0\].shape\[1\]`"),
        (("caches", 1, "pages", "block_size"), 0, r"at `\$.caches\[1\].pages.block_size`"),
        (("caches", 0, "kv_lora_rank"), 0, r"at `\$.caches\[0\].kv_lora_rank`"),
    ],
)
def test_bad_field_types_are_corrupt_data_naming_the_path(path, value, message):
    raw = msgspec.json.decode(encode_header_json(sample_header()))
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(CorruptData, match=message):
        decode_header_json(msgspec.json.encode(raw))


def test_unknown_field_is_corrupt_data():
    raw = msgspec.json.decode(encode_header_json(sample_header()))
    raw["caches"][0]["surprise"] = 1
    with pytest.raises(CorruptData, match="unknown field `surprise`"):
        decode_header_json(msgspec.json.encode(raw))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"[]", b"{}", b"null", b"\x81\xa1a\x01"])
def test_garbage_is_corrupt_data(data):
    with pytest.raises(CorruptData):
        decode_header(data)
    with pytest.raises(CorruptData):
        decode_header_json(data)


def test_non_bytes_input_is_corrupt_data():
    with pytest.raises(CorruptData, match="must be bytes"):
        decode_header(12)  # type: ignore[arg-type]
