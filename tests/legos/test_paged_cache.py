"""LatentPages mechanics (allocation, growth, block boundaries, gather order, trim, keep, restore) and the
paged cache over them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from bit_exact import bits
from kvshelf.errors import InvalidCacheState
from kvshelf.latent_legos import AffineFormat, LatentGeometry, LatentPages, MLACache, PagedLatentCache, TurboFormat
from kvshelf.latent_legos.encodings.family import family_encoding

G = LatentGeometry(kv_lora_rank=64, rope_head_dim=32, index_head_dim=32)


def positions(start: int, count: int, width: int = 2) -> mx.array:
    """Plane [1, count, width] whose position p holds the value p (easy to follow through the pages)."""
    values = np.repeat(np.arange(start, start + count, dtype=np.float32)[:, None], width, axis=1)
    return mx.array(values[None])


def gathered(pages: LatentPages) -> list[float]:
    return np.array(pages.gather()[0])[0, :, 0].tolist()


def test_allocation_growth_and_block_boundaries():
    pages = LatentPages(3)
    pages.append([positions(0, 2)])
    assert (pages.num_blocks, pages.block_table, pages.free_list, pages.offset) == (1, [0], [], 2)
    pages.append([positions(2, 5)])  # crosses two block boundaries: 2 | 3 4 5 | 6
    assert (pages.num_blocks, pages.block_table, pages.offset) == (3, [0, 1, 2], 7)
    assert gathered(pages) == list(range(7))
    assert tuple(pages.pools[0].shape) == (3, 3, 2)
    sizes = []
    for start in range(7, 40, 3):
        pages.append([positions(start, 3)])
        sizes.append(pages.num_blocks)
    # blocks needed 4, 5, ..., 14 (offsets 10..40): grow 3 -> 5 -> 8 -> 12 -> 18 (max(n + 1, ceil(1.5 n)))
    assert sizes == [5, 5, 8, 8, 8, 12, 12, 12, 12, 18, 18]
    assert gathered(pages) == list(range(40))


def test_trim_returns_tail_blocks_and_low_numbers_go_first():
    pages = LatentPages(2)
    pages.append([positions(0, 8)])
    assert pages.block_table == [0, 1, 2, 3]
    pages.trim(5)
    # pools grew 1 -> 2 -> 3 -> 5 blocks, block 4 never used
    assert (pages.offset, pages.block_table, pages.free_list) == (3, [0, 1], [2, 3, 4])
    pages.append([positions(100, 3)])
    assert pages.block_table == [0, 1, 2] and pages.free_list == [3, 4]
    assert gathered(pages) == [0, 1, 2, 100, 101, 102]
    pages.trim(100)
    assert (pages.offset, pages.block_table, pages.free_list) == (0, [], [0, 1, 2, 3, 4])


def test_gather_follows_the_block_table_and_restored_rebuilds_the_free_list():
    pool = mx.array(np.arange(5 * 2 * 1, dtype=np.float32).reshape(5, 2, 1))
    pages = LatentPages.restored(2, [pool], [3, 0, 4], 5, 5)
    assert pages.free_list == [1, 2]
    assert np.array(pages.gather()[0])[0, :, 0].tolist() == [6, 7, 0, 1, 8]
    pages.append([mx.array([[[50.0]]])])
    assert pages.block_table == [3, 0, 4] and gathered(pages) == [6, 7, 0, 1, 8, 50]
    pages.append([mx.array([[[60.0]]])])
    assert pages.block_table == [3, 0, 4, 1]
    assert float(pool[1, 0, 0]) == 2.0  # the adopted array object itself is never written
    for table, blocks, offset in (([3, 0], 5, 5), ([3, 3, 1], 5, 5), ([3, 0, 5], 5, 5)):
        with pytest.raises(InvalidCacheState):
            LatentPages.restored(2, [pool], table, blocks, offset)
    with pytest.raises(InvalidCacheState):
        LatentPages.restored(3, [pool], [3, 0], 5, 5)


def test_keep_rewrites_a_row_to_a_window():
    pages = LatentPages(2)
    pages.append([positions(0, 7)])
    pages.keep(2, 5)
    assert (pages.offset, pages.block_table, gathered(pages)) == (3, [0, 1], [2, 3, 4])
    with pytest.raises(InvalidCacheState):
        pages.keep(2, 4)


def inputs(batch: int, length: int, seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((batch, length, w)).astype(np.float32)) for w in G.widths]


def test_f32_pages_read_mla_bits_and_extract_is_independent():
    paged, mla = PagedLatentCache(G, None, 4), MLACache(G)
    for length, seed in ((5, 1), (1, 2), (6, 3)):
        a, b = paged.append_latent(*inputs(2, length, seed)), mla.append_latent(*inputs(2, length, seed))
        for x, y in zip((a.latent, a.rope, a.index_keys), (b.latent, b.rope, b.index_keys)):
            assert np.array_equal(bits(x), bits(y))
    assert paged.signature() == "kv:latent-paged:dsa:f32:4"
    assert [p.offset for p in paged.pages] == [12, 12] and paged.pages[0].block_table == [0, 1, 2]
    assert len(paged.state) == 2 * 3 and paged.bytes_per_token() == 4 * 128
    before = bits(paged.read_latent().latent)
    row = paged.extract_row(1)
    row.append_latent(*inputs(1, 2, 9))
    row.trim(5)
    row.append_latent(*inputs(1, 4, 10))  # rewrites blocks the source row still uses
    assert paged.row_offsets == [12, 12] and row.row_offsets == [13]
    assert np.array_equal(bits(paged.read_latent().latent), before)
    assert np.array_equal(bits(paged.stored_index_keys()), bits(mla.stored_index_keys()))
    fresh = paged.make_empty_batch()
    fresh.adopt_rows([p.clone() for p in paged.pages])
    assert np.array_equal(bits(fresh.read_latent().latent), bits(mla.read_latent().latent))
    with pytest.raises(InvalidCacheState):
        fresh.adopt_rows([LatentPages(8)])


@pytest.mark.parametrize("fmt", [AffineFormat(4, 32), TurboFormat(8, 3), TurboFormat(3, 3)])
def test_encoded_pages_read_the_encoding_of_every_position(fmt):
    cache = PagedLatentCache(G, fmt, 3)
    chunks = [inputs(2, 4, 1), inputs(2, 3, 2)]
    for chunk in chunks:
        read = cache.append_latent(*chunk)
    assert cache.signature() == f"kv:latent-paged:dsa:{'affine:4:32' if isinstance(fmt, AffineFormat) else f'turbo:{fmt.k_bits}:3'}:3"
    assert len(cache.pages[0].pools) == 9  # three planes per family
    for f, width in enumerate(G.widths):
        enc = family_encoding(fmt, width)
        whole = mx.concatenate([c[f] for c in chunks], axis=1)
        expected = enc.decode(enc.encode(whole))
        assert np.array_equal(bits((read.latent, read.rope, read.index_keys)[f]), bits(expected))
    pools = cache.pages[0].pools
    assert cache.bytes_per_token() == sum(p.nbytes for p in pools) // (pools[0].shape[0] * pools[0].shape[1])
    assert cache.projected_bytes(10) == 10 * 4 * 128
