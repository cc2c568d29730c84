"""Load-time validation of entries and arrays handed to a codec directly (the store's path, no file)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from codec_cases import CASES_BY_ID, describe, filled
from msgspec.structs import replace

from kvshelf.codecs import default_provider
from kvshelf.errors import CorruptData, IncompatibleFormat, KvShelfError


def snap(case_id: str):
    cache = filled(CASES_BY_ID[case_id])
    entry, arrays = default_provider.snapshot(cache)
    return cache, entry, arrays


def load(entry, arrays, **kw):
    return default_provider.load(entry, arrays, index=3, **kw)


def test_checksum_mismatch_is_caught_and_verify_false_skips_it():
    cache, entry, arrays = snap("mla-f32-nodsa")
    changed = [arrays[0] + 1.0, arrays[1]]
    with pytest.raises(CorruptData, match=r"entry 3 \(mla\) field tensors\[0\].checksum: latent: stored"):
        load(entry, changed)
    assert load(entry, changed, verify=False).offset == 8


def test_wrong_number_of_arrays():
    _, entry, arrays = snap("encoded-affine4-nodsa-unconverted")
    with pytest.raises(CorruptData, match=r"entry 3 \(latent-encoded\) field tensors: 8 slots but 7 arrays"):
        load(entry, arrays[:-1])


def test_array_that_contradicts_its_slot():
    _, entry, arrays = snap("paged-turbo4-nodsa")
    bad = list(arrays)
    bad[1] = bad[1].astype(mx.float32)
    with pytest.raises(CorruptData, match=r"tensors\[1\]: latent.1.pool: slot says float16 \[2, 4, 2\], array is float32"):
        load(entry, bad)
    with pytest.raises(CorruptData, match=r"tensors\[0\]: latent.0.pool: expected an mlx array, got list"):
        load(entry, [[1, 2]] + list(arrays[1:]))


def test_nbytes_that_contradict_the_shape():
    _, entry, arrays = snap("mla-f32-nodsa")
    bad = replace(entry, tensors=[replace(entry.tensors[0], nbytes=5), entry.tensors[1]])
    with pytest.raises(CorruptData, match=r"tensors\[0\].nbytes: latent: expected 2048, got 5"):
        load(bad, arrays)


def test_wrong_slot_names_and_token_axes():
    _, entry, arrays = snap("mla-f32-nodsa")
    renamed = replace(entry, tensors=[entry.tensors[1], entry.tensors[0]])
    with pytest.raises(IncompatibleFormat, match=r"tensors\[0\].name: expected 'latent', got 'rope'"):
        load(renamed, arrays)
    no_axis = replace(entry, tensors=[replace(entry.tensors[0], token_axis=None), entry.tensors[1]])
    with pytest.raises(IncompatibleFormat, match=r"tensors\[0\].token_axis: latent: expected 1, got None"):
        load(no_axis, arrays)


@pytest.mark.parametrize(
    "case_id, changes, message",
    [
        ("mla-f32-nodsa", {"bits": 4, "group_size": 32}, r"field bits: an f32 mla entry has no bits"),
        ("mla-f32-nodsa", {"index_head_dim": 32}, r"kind 'mla' cannot have an index_head_dim"),
        ("mla-f32-dsa", {"kind": "mla"}, r"kind 'mla' cannot have an index_head_dim"),
        ("mla-f32-nodsa", {"kv_lora_rank": None}, r"field kv_lora_rank: missing"),
        ("encoded-affine4-nodsa-converted", {"bits": None, "group_size": None}, r"an encoded entry needs a format"),
        ("encoded-affine4-nodsa-converted", {"k_bits": 8, "v_bits": 3}, r"both an affine and a TurboQuant format"),
        ("encoded-affine4-nodsa-converted", {"group_size": None}, r"incomplete affine format"),
        ("encoded-affine4-nodsa-converted", {"bits": 7}, r"field format: affine bits must be one of"),
        ("encoded-affine4-nodsa-converted", {"group_size": 128}, r"field format: .*width"),
        ("encoded-turbo8-nodsa-converted", {"k_bits": 6}, r"field format: TurboQuant k_bits must be one of"),
        ("encoded-turbo8-nodsa-converted", {"shadow": True}, r"expected 8 tensors"),
        ("encoded-turbo8-nodsa-unconverted", {"shadow": False}, r"expected 6 tensors"),
        ("encoded-affine8-nodsa-converted", {"pages": {"block_size": 4, "block_table": [0, 1], "num_blocks": 2}},
         r"an encoded \(unpaged\) entry has no pages"),
        ("paged-f32-nodsa", {"pages": None}, r"field pages: missing"),
        ("paged-f32-nodsa", {"quantized_kv_start": 4}, r"a paged entry has neither"),
        ("paged-affine4-nodsa", {"bits": 8}, r"tensors\[0\].shape: latent.0.pool: expected \[2, 4, 16\], got \[2, 4, 8\]"),
    ],
)
def test_entries_that_contradict_their_kind(case_id, changes, message):
    import msgspec

    from kvshelf.codecs import PageLayout

    _, entry, arrays = snap(case_id)
    if isinstance(changes.get("pages"), dict):
        changes = dict(changes, pages=msgspec.convert(changes["pages"], PageLayout))
    with pytest.raises(IncompatibleFormat, match=r"entry 3 \(.*\) .*" + message):
        load(replace(entry, **changes), arrays)


def test_paged_floor_and_offset_checks():
    cache, entry, arrays = snap("paged-f32-nodsa")
    with pytest.raises(CorruptData, match="minimum_reusable_offset: 9 is above the offset 8"):
        load(replace(entry, minimum_reusable_offset=9), arrays)
    ok = load(replace(entry, minimum_reusable_offset=8), arrays)
    assert ok.minimum_reusable_offset == 8


def test_rejections_change_nothing_and_raise_only_our_errors():
    cache, entry, arrays = snap("encoded-turbo4-dsa-unconverted")
    before = describe(cache)
    for bad in (replace(entry, offset=7), replace(entry, kind="mla"), replace(entry, tensors=entry.tensors[:2])):
        with pytest.raises(KvShelfError):
            default_provider.load(bad, arrays)
    assert describe(cache) == before
