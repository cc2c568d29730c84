"""The portable single-file snapshot: format, atomicity, and every bad input refused with a clear error."""

from __future__ import annotations

import json
import os
import stat

import mlx.core as mx
import msgspec
import numpy as np
import pytest
import safetensors
from codec_cases import Case, bits, describe, filled

from kvshelf.codecs import default_provider, load_snapshot, read_header, save_snapshot
from kvshelf.codecs.header import PageLayout, decode_header_json, encode_header_json
from kvshelf.codecs.snapshot_file import HEADER_CHECKSUM_KEY, HEADER_KEY
from kvshelf.codecs.checksum import checksum_bytes
from kvshelf.errors import CorruptData, IdentityMismatch, IncompatibleFormat, InvalidCacheState, KvShelfError

IDENTITY = {"model_id": "glm-test", "config_fingerprint": "cfg-1", "tokenizer_hash": "tok-1", "namespace": "ns-a"}
MLA = Case("mla", "f32", True, False)
PAGED = Case("paged", "affine4", False, False)


def caches():
    return [filled(MLA), filled(PAGED)]


@pytest.fixture
def snap(tmp_path):
    path = tmp_path / "s.safetensors"
    save_snapshot(path, list(range(100, 108)), caches(), identity=IDENTITY)
    return path


# -- framing helpers: rewrite a file as another writer (or a bit flip) would --------------------------------------


def split(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(path, table, body):
    raw = json.dumps(table).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def rewrite_header(path, change):
    """Apply ``change(raw header dict)`` and re-sign the header, so only deeper validation can catch it."""
    table, body = split(path)
    raw = msgspec.json.decode(table["__metadata__"][HEADER_KEY].encode())
    change(raw)
    text = msgspec.json.encode(raw).decode()
    table["__metadata__"][HEADER_KEY] = text
    table["__metadata__"][HEADER_CHECKSUM_KEY] = checksum_bytes(text.encode())
    join(path, table, body)


def header_span(path):
    n = int.from_bytes(path.read_bytes()[:8], "little")
    return 8, 8 + n


def flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# -- the format -----------------------------------------------------------------------------------------------------


def test_round_trip_returns_tokens_caches_and_header(snap):
    originals = caches()
    result = load_snapshot(snap, expect=IDENTITY)
    assert result.tokens == list(range(100, 108))
    assert [describe(c) for c in result.caches] == [describe(c) for c in originals]
    assert result.header.provider == "kvshelf-cache-v1"
    assert [e.kind for e in result.header.caches] == ["mla-dsa", "latent-paged"]
    assert {f: getattr(result.header, f) for f in IDENTITY} == IDENTITY


def test_file_is_private_and_no_temporary_remains(snap):
    assert stat.S_IMODE(os.stat(snap).st_mode) == 0o600
    assert sorted(p.name for p in snap.parent.iterdir()) == ["s.safetensors"]


def test_opens_in_the_safetensors_library(snap):
    header = read_header(snap)
    with safetensors.safe_open(str(snap), "numpy") as f:
        assert sorted(f.keys()) == sorted(f"{i}.{s.name}" for i, e in enumerate(header.caches) for s in e.tensors)
        assert decode_header_json(f.metadata()[HEADER_KEY]) == header
        latent = f.get_tensor("0.latent")
    entry, arrays = default_provider.snapshot(filled(MLA))
    assert latent.tobytes() == np.array(arrays[0]).tobytes()


def test_bfloat16_tensors_survive_through_the_mlx_writer(tmp_path):
    from test_codecs_provider import ToyCache, toy_provider

    cache = ToyCache(mx.arange(24, dtype=mx.float32).reshape(1, 8, 3).astype(mx.bfloat16))
    path = tmp_path / "bf16.safetensors"
    save_snapshot(path, list(range(8)), [cache], provider=toy_provider)
    loaded = load_snapshot(path, provider=toy_provider).caches[0]
    assert loaded.values.dtype == mx.bfloat16 and bits(loaded.values) == bits(cache.values)


def test_read_header_reads_no_tensor_bytes(snap):
    full = read_header(snap)
    start, end = header_span(snap)
    snap.write_bytes(snap.read_bytes()[:end])  # every tensor byte gone
    assert read_header(snap) == full
    with pytest.raises(CorruptData, match="truncated"):
        load_snapshot(snap)


def test_identity_may_be_an_object_with_attributes(tmp_path):
    class Identity:
        model_id, config_fingerprint, tokenizer_hash = "m", "c", "t"

    path = tmp_path / "o.safetensors"
    save_snapshot(path, list(range(8)), [filled(MLA)], identity=Identity())
    header = load_snapshot(path, expect=Identity()).header
    assert (header.model_id, header.config_fingerprint, header.tokenizer_hash, header.namespace) == ("m", "c", "t", "")


def test_save_replaces_an_existing_file_atomically(snap):
    before = read_header(snap)
    save_snapshot(snap, list(range(8)), [filled(MLA)], identity={"model_id": "next"})
    assert read_header(snap).model_id == "next" and read_header(snap).created_at >= before.created_at
    assert sorted(p.name for p in snap.parent.iterdir()) == ["s.safetensors"]


def test_failed_save_leaves_nothing_behind(snap):
    before = snap.read_bytes()
    with pytest.raises(InvalidCacheState, match="holds 8 positions but 3 tokens"):
        save_snapshot(snap, [1, 2, 3], caches())
    assert snap.read_bytes() == before
    assert sorted(p.name for p in snap.parent.iterdir()) == ["s.safetensors"]


def test_tokens_may_be_arrays(tmp_path):
    path = tmp_path / "t.safetensors"
    save_snapshot(path, mx.array(list(range(8)), dtype=mx.int32), [filled(MLA)])
    assert load_snapshot(path).tokens == list(range(8))
    with pytest.raises(InvalidCacheState, match=r"tokens\[2\] must be a non-negative int"):
        save_snapshot(path, [0, 1, -2, 3, 4, 5, 6, 7], [filled(MLA)])


def test_batched_cache_is_refused_before_anything_is_written(tmp_path):
    cache = Case("mla", "f32", False, False).make()
    from codec_cases import append

    append(cache, 8, 0, batch=2)
    with pytest.raises(InvalidCacheState, match="extract_row"):
        save_snapshot(tmp_path / "b.safetensors", list(range(8)), [cache])
    assert list(tmp_path.iterdir()) == []


# -- bad input, one test each ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 5, 8, 40, -1])
def test_truncated_file(snap, keep):
    data = snap.read_bytes()
    snap.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(CorruptData):
        load_snapshot(snap)


def test_flipped_byte_in_a_tensor(snap):
    table, _ = split(snap)
    _, end = header_span(snap)
    flip(snap, end + table["0.latent"]["data_offsets"][0] + 17)
    with pytest.raises(CorruptData, match=r"entry 0 \(mla-dsa\) field tensors\[0\].checksum: latent: stored [0-9a-f]{32}, computed"):
        load_snapshot(snap)
    load_snapshot(snap, verify=False)  # without verification the bytes load (they decode to other values)


def test_flipped_byte_in_the_header_text(snap):
    text = snap.read_bytes()
    at = text.index(b"glm-test")
    flip(snap, at)
    with pytest.raises(CorruptData, match="header checksum mismatch"):
        load_snapshot(snap)
    with pytest.raises(CorruptData, match="header checksum mismatch"):
        read_header(snap)


def test_every_flipped_header_byte_is_caught_or_harmless(tmp_path):
    path = tmp_path / "small.safetensors"
    save_snapshot(path, list(range(8)), [filled(MLA)])
    original = path.read_bytes()
    reference = describe(load_snapshot(path).caches[0])
    start, end = header_span(path)
    for at in range(0, end):
        data = bytearray(original)
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
        try:
            result = load_snapshot(path)
        except KvShelfError:
            continue
        assert describe(result.caches[0]) == reference, f"flip at byte {at} changed the loaded cache silently"


def test_unknown_provider_id(snap):
    rewrite_header(snap, lambda raw: raw.update(provider="someone-else-v9"))
    with pytest.raises(IncompatibleFormat, match="written by codec provider 'someone-else-v9'; this reader is 'kvshelf-cache-v1'"):
        load_snapshot(snap)


def test_unknown_kind(snap):
    rewrite_header(snap, lambda raw: raw["caches"][1].update(kind="latent-hologram"))
    with pytest.raises(IncompatibleFormat, match="no codec for cache kind 'latent-hologram'"):
        load_snapshot(snap)


def test_other_format_version(snap):
    rewrite_header(snap, lambda raw: raw.update(format_version=7))
    with pytest.raises(IncompatibleFormat, match="format_version 7"):
        load_snapshot(snap)


def test_wrong_tensor_count(snap):
    rewrite_header(snap, lambda raw: raw["caches"][0]["tensors"].pop())
    with pytest.raises(IncompatibleFormat, match=r"entry 0 \(mla-dsa\) field tensors: expected 3 tensors \(latent, rope, index\), got 2"):
        load_snapshot(snap)


def test_shape_contradicting_the_geometry(snap):
    def change(raw):
        raw["caches"][0]["kv_lora_rank"] = 32

    rewrite_header(snap, change)
    with pytest.raises(IncompatibleFormat, match=r"entry 0 \(mla-dsa\) field tensors\[0\].shape: latent: expected \[1, 8, 32\], got \[1, 8, 64\]"):
        load_snapshot(snap)


def test_dtype_contradicting_the_geometry(snap):
    def change(raw):
        slot = raw["caches"][0]["tensors"][1]
        slot["dtype"], slot["nbytes"] = "float16", slot["nbytes"] // 2

    rewrite_header(snap, change)
    with pytest.raises(IncompatibleFormat, match=r"entry 0 \(mla-dsa\) field tensors\[1\].dtype: rope: expected float32, got float16"):
        load_snapshot(snap)


def test_file_tensor_table_contradicting_the_header(snap):
    table, body = split(snap)
    table["0.rope"]["dtype"] = "F16"
    join(snap, table, body)
    with pytest.raises(CorruptData, match=r"entry 0 \(mla-dsa\) field tensors\[1\] \(0.rope\): header says float32"):
        load_snapshot(snap)


def test_minimum_reusable_offset_above_the_offset(snap):
    rewrite_header(snap, lambda raw: raw["caches"][0].update(minimum_reusable_offset=9))
    with pytest.raises(CorruptData, match=r"entry 0 \(mla-dsa\) field minimum_reusable_offset: 9 is above the offset 8"):
        load_snapshot(snap)


def test_offset_above_max_tokens(snap):
    rewrite_header(snap, lambda raw: raw["caches"][0].update(max_tokens=7))
    with pytest.raises(CorruptData, match=r"entry 0 \(mla-dsa\) field offset: 8 exceeds max_tokens 7"):
        load_snapshot(snap)


def test_offset_disagreeing_with_the_tokens(snap):
    rewrite_header(snap, lambda raw: raw.update(tokens=raw["tokens"][:-1]))
    with pytest.raises(CorruptData, match=r"entry 0 \(mla-dsa\) field offset: 8, but the header has 7 tokens"):
        load_snapshot(snap)


def test_block_table_with_a_duplicate_block(snap):
    rewrite_header(snap, lambda raw: raw["caches"][1]["pages"].update(block_table=[1, 1]))
    with pytest.raises(CorruptData, match=r"entry 1 \(latent-paged\) field pages.block_table\[1\]: block 1 appears twice"):
        load_snapshot(snap)


def test_block_table_with_an_out_of_range_block(snap):
    rewrite_header(snap, lambda raw: raw["caches"][1]["pages"].update(block_table=[0, 2]))
    with pytest.raises(CorruptData, match=r"entry 1 \(latent-paged\) field pages.block_table\[1\]: block 2 is out of range \(num_blocks 2\)"):
        load_snapshot(snap)


def test_block_table_not_covering_the_offset(snap):
    rewrite_header(snap, lambda raw: raw["caches"][1]["pages"].update(block_table=[0]))
    with pytest.raises(CorruptData, match=r"entry 1 \(latent-paged\) field pages.block_table: 1 blocks of 4 for offset 8"):
        load_snapshot(snap)


@pytest.mark.parametrize("field", list(IDENTITY))
def test_identity_mismatch_names_the_field_and_both_values(snap, field):
    expect = dict(IDENTITY, **{field: "other"})
    with pytest.raises(IdentityMismatch) as caught:
        load_snapshot(snap, expect=expect)
    assert (caught.value.field, caught.value.stored, caught.value.expected) == (field, IDENTITY[field], "other")
    assert f"{field} mismatch: stored {IDENTITY[field]!r}, expected 'other'" in str(caught.value)


def test_expect_checks_only_the_fields_given(snap):
    assert load_snapshot(snap, expect={"namespace": "ns-a"}).header.namespace == "ns-a"
    with pytest.raises(InvalidCacheState, match="unknown fields"):
        load_snapshot(snap, expect={"model": "x"})


def test_not_a_kvshelf_file(tmp_path):
    path = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(path), {"x": mx.zeros((2,))})
    with pytest.raises(CorruptData, match="not a kvshelf snapshot"):
        read_header(path)


def test_extra_tensor_in_the_file(snap):
    table, body = split(snap)
    table["9.stowaway"] = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}
    join(snap, table, body)
    with pytest.raises(CorruptData, match="not named by the header"):
        load_snapshot(snap)


def test_page_layout_survives_the_file(snap):
    entry = read_header(snap).caches[1]
    assert entry.pages == PageLayout(block_size=4, block_table=[0, 1], num_blocks=2)
    assert encode_header_json(read_header(snap))  # re-encodes
