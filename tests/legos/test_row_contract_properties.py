"""The batch-row contract, for all operation sequences: ``PagedLatentCache(format=None)`` reads the bits
``MLACache`` reads, and both read what a plain per-row reference model says (rows right-justified, zeros in
padding, rejected positions never reappearing). ``EncodedLatentCache`` runs alongside: a row reads the reference
bits until it converts (f32-first rule) and the reference through its encoding after."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bit_exact import bits
from kvshelf.latent_legos import AffineFormat, EncodedLatentCache, TurboFormat
from kvshelf.latent_legos.contracts import PrefillPadding
from kvshelf.latent_legos.encodings.family import family_encoding
from kvshelf.latent_legos.latent.geometry import LatentGeometry
from kvshelf.latent_legos.latent.mla import MLACache
from kvshelf.latent_legos.latent.paged import PagedLatentCache

GEOMETRY = LatentGeometry(kv_lora_rank=64, rope_head_dim=32, index_head_dim=32)
WIDTHS = GEOMETRY.widths


class Reference:
    """Per row, a list of stored positions (leading prefill padding included, as zeros)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.rows: list[list[np.ndarray]] | None = None  # rows[b][f]: [n, W_f]
        self.lead: list[int] = []
        self.converted: list[bool] = []  # what an EncodedLatentCache at ``start`` has converted
        self.ends: list[int] | None = None
        self.round: list[int] | None = None

    def lengths(self) -> list[int]:
        return [len(r[0]) for r in self.rows] if self.rows is not None else []

    @property
    def row_offsets(self) -> list[int]:
        return [n - lead for n, lead in zip(self.lengths(), self.lead)]

    @property
    def width(self) -> int:
        return max(self.lengths(), default=0)

    def read(self) -> list[np.ndarray]:
        width = self.width
        out = []
        for f, w in enumerate(WIDTHS):
            out.append(np.stack([np.concatenate([np.zeros((width - len(r[f]), w), np.float32), r[f]])
                                 for r in self.rows]))
        return out

    def append(self, families: list[np.ndarray]) -> None:
        batch, length = families[0].shape[:2]
        if self.rows is None:
            self.begin(batch)
        for b, row in enumerate(self.rows):
            pending = max(0, self.lead[b] - len(row[0]))
            for f in range(len(WIDTHS)):
                chunk = families[f][b].copy()
                chunk[:pending] = 0.0
                row[f] = np.concatenate([row[f], chunk])
        self.converted = [c or (o >= self.start and o != 0) for c, o in zip(self.converted, self.row_offsets)]

    def begin(self, batch: int) -> None:
        self.rows = [[np.zeros((0, w), np.float32) for w in WIDTHS] for _ in range(batch)]
        self.lead, self.converted = [0] * batch, [False] * batch

    def encoded_read(self, fmt) -> list[np.ndarray]:
        """Converted rows through the encoding, the rest as stored, padding zero."""
        out = []
        pads = [self.width - o for o in self.row_offsets]
        for w, plain in zip(WIDTHS, self.read()):
            enc = family_encoding(fmt, w)
            decoded = np.array(enc.decode(enc.encode(mx.array(plain)))) if plain.shape[1] else plain
            mixed = np.where(np.array(self.converted)[:, None, None], decoded, plain)
            for b, pad in enumerate(pads):
                mixed[b, :pad] = 0.0
            out.append(mixed)
        return out

    def drop_tail(self, counts: list[int]) -> None:
        for row, n in zip(self.rows, counts):
            for f in range(len(WIDTHS)):
                row[f] = row[f][: len(row[f]) - n]

    def finalize(self) -> None:
        for b, row in enumerate(self.rows):
            end = min(len(row[0]), self.ends[b]) if self.ends else len(row[0])
            for f in range(len(WIDTHS)):
                row[f] = row[f][self.lead[b] : end]
        self.lead, self.ends = [0] * len(self.rows), None

    def select(self, keep: list[int]) -> None:
        self.rows = [self.rows[k] for k in keep]
        self.lead = [self.lead[k] for k in keep]
        self.converted = [self.converted[k] for k in keep]


def random_families(rng: np.random.Generator, batch: int, length: int) -> list[np.ndarray]:
    return [rng.standard_normal((batch, length, w)).astype(np.float32) + 0.5 for w in WIDTHS]


class Harness:
    """MLACache, f32 pages and an EncodedLatentCache driven alike, next to the reference."""

    def __init__(self, block_size: int, fmt, start: int) -> None:
        self.fmt, self.start = fmt, start
        self.caches = [MLACache(GEOMETRY), PagedLatentCache(GEOMETRY, None, block_size),
                       EncodedLatentCache(GEOMETRY, fmt, start)]
        self.ref = Reference(start)

    def expected(self, cache) -> list[np.ndarray]:
        return self.ref.encoded_read(self.fmt) if isinstance(cache, EncodedLatentCache) else self.ref.read()

    def check(self) -> None:
        for cache in self.caches:
            assert cache.batch_size == (len(self.ref.rows) if self.ref.rows is not None else None)
            if self.ref.rows is None:
                continue
            assert cache.offset == self.ref.width
            assert cache.row_offsets == self.ref.row_offsets
            assert cache.left_pad == [self.ref.width - o for o in self.ref.row_offsets]
            if isinstance(cache, EncodedLatentCache):
                assert cache.converted == self.ref.converted
            assert_reads(cache.read_latent(), self.expected(cache))

    def append(self, families: list[np.ndarray]) -> None:
        reads = [c.append_latent(*[mx.array(f) for f in families]) for c in self.caches]
        before = list(self.ref.converted) if self.ref.rows is not None else None
        self.ref.append(families)
        # The append that converts a row still reads that row in f32 (the f32-first rule).
        after, self.ref.converted = self.ref.converted, before or [False] * len(self.ref.rows)
        expected = [self.expected(cache) for cache in self.caches]
        self.ref.converted = after
        for read, want in zip(reads, expected):
            assert_reads(read, want)
        self.check()


def assert_reads(got, expected: list[np.ndarray]) -> None:
    for g, e in zip((got.latent, got.rope, got.index_keys), expected):
        assert np.array_equal(bits(g), bits(e))


@st.composite
def prefill_layout(draw, batch: int, fresh: bool):
    """Per row real tokens and padding that add up to one column count."""
    real = [draw(st.integers(0 if not fresh else 1, 5)) for _ in range(batch)]
    columns = max(real) + draw(st.integers(0, 2))
    if columns == 0:
        columns = 1
    left, right = [], []
    for r in real:
        spare = columns - r
        lp = draw(st.integers(0, spare)) if fresh else 0
        left.append(lp)
        right.append(spare - lp)
    return columns, left, right


@settings(max_examples=50)
@given(
    data=st.data(),
    block_size=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    fmt=st.sampled_from([AffineFormat(4, 32), TurboFormat(4, 3), TurboFormat(8, 3)]),
    start=st.sampled_from([0, 4, 9, 10**6]),
)
def test_paged_f32_reads_mla_bits_and_the_reference(data, block_size, seed, fmt, start):
    rng = np.random.default_rng(seed)
    h = Harness(block_size, fmt, start)
    batch = data.draw(st.integers(1, 3), label="batch")
    if data.draw(st.booleans(), label="start with a padded prefill"):
        do_prefill(h, data, rng, batch, fresh=True)
    else:
        h.append(random_families(rng, batch, data.draw(st.integers(1, 6))))
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        op = data.draw(st.sampled_from(["append", "trim", "spec", "prefill", "filter", "merge", "extract", "fresh"]))
        batch = len(h.ref.rows)
        if op == "append":
            h.append(random_families(rng, batch, data.draw(st.integers(1, 5))))
        elif op == "trim":
            n = data.draw(st.integers(0, min(h.ref.row_offsets)))
            for cache in h.caches:
                assert cache.trim(n) == n
            h.ref.drop_tail([n] * batch)
            h.check()
        elif op == "spec":
            do_spec_round(h, data, rng, batch)
        elif op == "prefill":
            do_prefill(h, data, rng, batch, fresh=False)
        elif op == "filter":
            keep = data.draw(st.permutations(range(batch)))[: data.draw(st.integers(1, batch))]
            for cache in h.caches:
                cache.filter_rows(keep)
            h.ref.select(keep)
            h.check()
        elif op == "merge":
            do_merge(h, data, batch)
        elif op == "extract":
            row = data.draw(st.integers(0, batch - 1))
            length = h.ref.row_offsets[row]
            for cache in h.caches:
                expected = [e[row, e.shape[1] - length :] for e in h.expected(cache)]
                single = cache.extract_row(row)
                assert (single.batch_size, single.offset, single.row_offsets) == (1, length, [length])
                got = single.read_latent()
                for g, e in zip((got.latent, got.rope, got.index_keys), expected):
                    assert np.array_equal(bits(g[0]), bits(e))
        elif op == "fresh":
            for cache in h.caches:
                cache.dispose()
                assert cache.batch_size is None and cache.offset == 0 and cache.state == []
            h.ref = Reference(h.start)
            do_prefill(h, data, rng, data.draw(st.integers(1, 3)), fresh=True)


def do_spec_round(h: Harness, data, rng, batch: int) -> None:
    for cache in h.caches:
        cache.spec_round_begin()
    window = data.draw(st.integers(1, 4))
    h.append(random_families(rng, batch, window))
    how = data.draw(st.sampled_from(["commit", "equal", "per-row"]))
    if how == "commit":
        for cache in h.caches:
            cache.spec_round_commit()
        return
    keep = data.draw(st.integers(0, window)) if how == "equal" else [
        data.draw(st.integers(0, window)) for _ in range(batch)]
    counts = [keep] * batch if isinstance(keep, int) else keep
    for cache in h.caches:
        cache.spec_round_rollback(keep)
    h.ref.drop_tail([window - k for k in counts])
    h.check()


def do_prefill(h: Harness, data, rng, batch: int, fresh: bool) -> None:
    columns, left, right = data.draw(prefill_layout(batch, fresh))
    lengths = [columns - r for r in right]
    padding = PrefillPadding(lengths, left if any(left) else None, right)
    for cache in h.caches:
        cache.prepare_prefill(padding)
    if h.ref.rows is None:
        h.ref.begin(batch)
    h.ref.lead = [a + b for a, b in zip(h.ref.lead, left)]
    h.ref.ends = [n + length for n, length in zip(h.ref.lengths(), lengths)]
    first = data.draw(st.integers(1, columns))  # a chunked prefill: one or two appends
    h.append(random_families(rng, batch, first))
    if columns > first:
        h.append(random_families(rng, batch, columns - first))
    for cache in h.caches:
        cache.finalize_prefill()
    h.ref.finalize()
    h.check()


def do_merge(h: Harness, data, batch: int) -> None:
    """Rebuild the batch from extracted rows, in a drawn order, with an empty source somewhere."""
    order = data.draw(st.permutations(range(batch)))
    empty_at = data.draw(st.integers(0, batch)) if data.draw(st.booleans()) else None
    for i, cache in enumerate(h.caches):
        sources = [cache.extract_row(r) for r in order]
        if empty_at is not None:
            sources.insert(empty_at, cache.make_empty_batch())
        merged = cache.make_empty_batch()
        merged.merge_rows(sources)
        h.caches[i] = merged
    rows = [h.ref.rows[r] for r in order]
    converted = [h.ref.converted[r] for r in order]
    if empty_at is not None:
        rows.insert(empty_at, [np.zeros((0, w), np.float32) for w in WIDTHS])
        converted.insert(empty_at, False)
    h.ref.rows, h.ref.lead, h.ref.converted = rows, [0] * len(rows), converted
    h.check()


def test_filter_during_a_pending_prefill_matches_mla():
    """Survivors of a filter taken between the padded append and finalize drop only their common padding."""
    rng = np.random.default_rng(3)
    caches = [MLACache(GEOMETRY), PagedLatentCache(GEOMETRY, None, 2)]
    families = random_families(rng, 3, 6)
    for cache in caches:
        cache.prepare_prefill(PrefillPadding([6, 5, 6], [3, 0, 2], [0, 1, 0]))
        cache.append_latent(*[mx.array(f) for f in families])
        cache.filter_rows([2, 0])
        assert (cache.offset, cache.row_offsets, cache.left_pad) == (4, [4, 3], [0, 1])
    reads = [c.read_latent() for c in caches]
    assert np.array_equal(bits(reads[0].latent), bits(reads[1].latent))
    expected = np.zeros((2, 4, 64), np.float32)
    expected[0] = families[0][2, 2:]
    expected[1, 1:] = families[0][0, 3:]
    assert np.array_equal(bits(reads[0].latent), bits(expected))
    for cache in caches:
        cache.finalize_prefill()
        assert (cache.offset, cache.row_offsets, cache.left_pad) == (4, [4, 3], [0, 1])
    reads = [c.read_latent() for c in caches]
    assert np.array_equal(bits(reads[1].latent), bits(expected))
