"""Crafted portable files that are well-formed enough to pass every checksum, refused anyway (issue 12):
tensors that overlap or leave the file, checksums emptied over zeroed data, and geometry no model has.

Each file is re-signed (header checksum recomputed) so only the checks under test can catch it.
"""

from __future__ import annotations

import pytest
from kv_cases import fill
from test_snapshot_file import join, rewrite_header, split
from tools_data import make_caches

from kvshelf.codecs import load_snapshot, read_header, save_snapshot
from kvshelf.codecs.validate import (
    MAX_BLOCK_SIZE,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_POSITIONS,
)
from kvshelf.errors import CorruptData, IncompatibleFormat
from kvshelf.latent_legos.kv import RotatingKVCache


@pytest.fixture
def mla(tmp_path):
    path = tmp_path / "mla.safetensors"
    save_snapshot(path, list(range(8)), make_caches("mla", 8, 0))
    return path


def test_overlapping_tensors_are_refused_even_when_every_checksum_agrees(mla) -> None:
    """0.rope is pointed at 0.latent's bytes and given 0.latent's checksum: every checksum passes, the caches
    would silently alias; the table check refuses it before a tensor byte is read."""
    def alias(raw):
        latent = next(s for s in raw["caches"][0]["tensors"] if s["name"] == "latent")
        rope = next(s for s in raw["caches"][0]["tensors"] if s["name"] == "rope")
        rope["checksum"] = latent["checksum"]

    rewrite_header(mla, alias)
    table, body = split(mla)
    table["0.rope"]["data_offsets"] = list(table["0.latent"]["data_offsets"])
    join(mla, table, body)
    for verify in (True, False):
        with pytest.raises(CorruptData, match="overlap"):
            load_snapshot(mla, verify=verify)


def test_partly_overlapping_tensors_are_refused(mla) -> None:
    table, body = split(mla)
    begin, end = table["0.latent"]["data_offsets"]
    table["0.rope"]["data_offsets"] = [begin + 4, end + 4]
    join(mla, table, body)
    with pytest.raises(CorruptData, match="overlap"):
        load_snapshot(mla, verify=False)


@pytest.mark.parametrize("offsets", [[6144, 7168], [2**40, 2**40 + 1024], [5120, 1024]])
def test_tensors_outside_the_file_are_refused(mla, offsets) -> None:
    table, body = split(mla)
    table["0.latent"]["data_offsets"] = offsets
    join(mla, table, body)
    with pytest.raises(CorruptData):
        load_snapshot(mla, verify=False)


def test_empty_checksums_over_zeroed_data_are_refused_under_verify(mla) -> None:
    def strip(raw):
        for entry in raw["caches"]:
            for slot in entry["tensors"]:
                slot["checksum"] = ""

    rewrite_header(mla, strip)
    table, body = split(mla)
    join(mla, table, bytes(len(body)))
    with pytest.raises(CorruptData, match="no checksum"):
        load_snapshot(mla)
    assert len(load_snapshot(mla, verify=False).caches) == 2  # the caller asked for unverified data: it is given


def test_one_missing_checksum_is_refused_under_verify(mla) -> None:
    rewrite_header(mla, lambda raw: raw["caches"][1]["tensors"][2].__setitem__("checksum", ""))
    with pytest.raises(CorruptData, match=r"entry 1 .*no checksum"):
        load_snapshot(mla)


@pytest.fixture
def ring(tmp_path):
    path = tmp_path / "ring.safetensors"
    cache = RotatingKVCache(16, 0)
    fill(cache, [6], dk=32, dv=32)
    save_snapshot(path, list(range(6)), [cache])
    return path


@pytest.mark.parametrize("key, value", [("max_size", 2**62), ("max_size", MAX_POSITIONS + 1), ("buffer", 2**62),
                                        ("kv_heads", MAX_HEADS + 1), ("k_head_dim", MAX_HEAD_DIM + 1)])
def test_absurd_rotating_geometry_is_refused_before_allocating(ring, key, value) -> None:
    rewrite_header(ring, lambda raw: raw["caches"][0]["extra"].__setitem__(key, value))
    for call in (load_snapshot, lambda p: load_snapshot(p, verify=False)):
        with pytest.raises(IncompatibleFormat, match=f"extra.{key}"):
            call(ring)
    assert read_header(ring).caches[0].extra[key] == value  # the header alone is still readable for inspection


@pytest.mark.parametrize("field, value", [("kv_lora_rank", 2**30), ("rope_head_dim", MAX_HEAD_DIM + 1),
                                          ("offset", 2**40)])
def test_absurd_latent_geometry_is_refused(mla, field, value) -> None:
    rewrite_header(mla, lambda raw: raw["caches"][0].__setitem__(field, value))
    with pytest.raises(IncompatibleFormat, match=f"{field}: {value} exceeds the supported maximum"):
        load_snapshot(mla, verify=False)


def test_absurd_paged_block_size_is_refused(tmp_path) -> None:
    path = tmp_path / "paged.safetensors"
    save_snapshot(path, list(range(8)), make_caches("paged-f32", 8, 0))

    def grow(raw):
        raw["caches"][0]["pages"]["block_size"] = MAX_BLOCK_SIZE + 1

    rewrite_header(path, grow)
    with pytest.raises(IncompatibleFormat, match="pages.block_size"):
        load_snapshot(path, verify=False)


def test_absurd_tensor_byte_count_is_refused(mla) -> None:
    rewrite_header(mla, lambda raw: raw["caches"][0]["tensors"][0].__setitem__("nbytes", 2**41))
    with pytest.raises(IncompatibleFormat, match="nbytes"):
        load_snapshot(mla, verify=False)
