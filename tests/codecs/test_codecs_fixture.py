"""A committed format-1 snapshot keeps loading: the on-disk format may only change with a new format_version.

Regenerate (only when the format version changes on purpose):
``PYTHONPATH=../helpers python -c "import test_codecs_fixture as t; t.write_fixture()"`` from ``tests/codecs/``.
"""

from __future__ import annotations

from pathlib import Path

from codec_cases import CASES_BY_ID, bits, filled, inputs

from kvshelf.codecs import default_provider, load_snapshot, read_header, save_snapshot

FIXTURE = Path(__file__).parents[1] / "data" / "snapshot-format1.safetensors"
CASE_IDS = ("mla-f32-dsa", "encoded-turbo8-nodsa-unconverted", "paged-affine4-nodsa")
IDENTITY = {"model_id": "fixture-model", "config_fingerprint": "cfg", "tokenizer_hash": "tok", "namespace": "fx"}


def write_fixture() -> None:
    caches = [filled(CASES_BY_ID[i], lengths=(3, 2), seed=11) for i in CASE_IDS]
    save_snapshot(FIXTURE, [9, 8, 7, 6, 5], caches, identity=IDENTITY)


def test_fixture_header_is_exactly_as_written():
    header = read_header(FIXTURE)
    assert (header.format_version, header.provider, header.tokens) == (1, "kvshelf-cache-v1", [9, 8, 7, 6, 5])
    assert {f: getattr(header, f) for f in IDENTITY} == IDENTITY
    assert [e.kind for e in header.caches] == ["mla-dsa", "latent-encoded", "latent-paged"]
    assert [len(e.tensors) for e in header.caches] == [3, 8, 6]
    assert header.caches[1].shadow is True and header.caches[1].quantized_kv_start == 40
    assert header.caches[2].pages.block_table == [0, 1] and header.caches[2].pages.num_blocks == 2


def test_fixture_loads_and_its_f32_state_is_the_original_input():
    snap = load_snapshot(FIXTURE, expect=IDENTITY)
    mla = snap.caches[0]
    first, second = inputs(mla.geometry, 3, 11), inputs(mla.geometry, 2, 12)
    import mlx.core as mx

    expected = [mx.concatenate([a, b], axis=1) for a, b in zip(first, second)]
    assert [bits(a) for a in mla.state] == [bits(e) for e in expected]


def test_fixture_caches_resnapshot_to_the_same_bytes():
    header = read_header(FIXTURE)
    snap = load_snapshot(FIXTURE)
    for entry, cache in zip(header.caches, snap.caches):
        again, _ = default_provider.snapshot(cache)
        assert [s.checksum for s in again.tensors] == [s.checksum for s in entry.tensors]
        assert again == entry
