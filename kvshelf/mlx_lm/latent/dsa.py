"""``DSALatentCache``: the ``CacheList`` face of a sparse-attention (DSA) MLA layer (glm_moe_dsa, deepseek_v32).

mlx-lm's layer code makes two calls per step: ``cache[0].update_and_fetch(latent, rope)`` returns the latent and
RoPE key reads, then the indexer calls ``cache[1].update_and_fetch(k, k)`` (reading ``cache[1].offset`` first, for
its RoPE) and zeroes ``cache[1].values``. One lego with an index family (``kv:mla:target:dsa`` and its encoded and
paged kinds) stores all three, so the scheme encodes the indexer keys as well; it takes them in one append.

The latent call therefore appends with zero index keys, which gives the lego's own latent and RoPE reads; the
indexer call trims that step and appends again with the real keys, and returns their reads. The encodings are
deterministic, so the stored state is what one append of all three would leave. The reads follow the f32-first
rule as one append would: a row that read its float32 shadow on this step (not yet converted when it began) reads
its index keys from the shadow as well, not from the re-append (which already sees the row converted).

At a decode step (L == 1) where every row reads its encoded planes, the layer attends on the planes, as
``MLALatentCache`` does, through a placeholder: the latent call appends with ``store_latent`` (nothing decoded) and
hands mlx-lm, as the latent, the column numbers ``[B, 1, T, 1]`` int32 (column t holds t; 4 bytes a position,
a broadcast of one ``arange``) and the RoPE key decoded (the model multiplies it itself). mlx-lm's sparse
selection gathers that placeholder with ``take_along_axis`` exactly as it would gather the latent, so what reaches
``scaled_dot_product_attention`` is the selected columns in mlx-lm's order (or the placeholder itself when the
history is no longer than ``index_topk``). kvshelf's installed attention asks the layer
(``attend_latent_placeholder``, it gets the layer as ``cache``) and attends on the codes, scales and biases of
those columns (``plane_attention.attend_gathered``): no decoded latent at all. The indexer call appends again with
``store_latent`` after the trim and decodes the index family only (the indexer multiplies its keys itself).
Rows still reading float32 (the f32-first rule), a float32 lego, prefill steps and ``attend_on_planes = False``
take the path below, today's exact reads.

Until the indexer call arrives the step is pending: anything else that touches the layer (another append, a trim,
a row operation, persisting it) raises ``InvalidCacheState`` rather than store placeholder index keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...errors import InvalidCacheState
from ...latent_legos.kv.model_face import batch_positions
from ...latent_legos.latent.plane_attention import LatentReads, attend_gathered
from ...latent_legos.rows import prefill_leads, zero_prefill_leads
from .attention import LatentKeys
from .attention import install as install_latent_attention
from .faces import F32, LatentLayer, heads_of_one


@dataclass
class _Pending:
    """One step between the latent call and the indexer call."""

    latent: mx.array
    rope: mx.array
    length: int
    shadow_rows: list[bool] | None  # rows that read their f32 shadow this step (None: every row reads the lego)
    index_before: mx.array | None  # the index reads before the step (for the shadow rows)
    leads: list[int]  # per row, columns of this step that land in pending left padding


@dataclass
class _PlanesStep:
    """A decode step attended on the planes: the placeholder handed to mlx-lm and, once the indexer keys are in,
    the step's reads (taken from the lego when attention runs, so nothing decoded is held)."""

    placeholder: mx.array
    reads: LatentReads | None = None


class _LatentFace:
    """``cache[0]`` of a DSA layer: the latent as keys, the RoPE key as values."""

    def __init__(self, layer: DSALatentCache) -> None:
        self._layer = layer

    @property
    def offset(self) -> int | mx.array:
        lego = self._layer.lego
        return batch_positions(lego.offset, lego.row_offsets, self._layer._batch_face)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._layer._stage(keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kw: Any) -> Any:
        return self._layer.make_mask(N, return_array=return_array, window_size=window_size, **kw)

    @property
    def keys(self) -> mx.array | None:
        return self._layer._reads[0]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._layer._assign(0, value)

    @property
    def values(self) -> mx.array | None:
        return self._layer._reads[1]

    @values.setter
    def values(self, value: mx.array) -> None:
        self._layer._assign(1, value)

    @property
    def state(self) -> list[mx.array]:
        return self._layer.state


class _IndexFace:
    """``cache[1]`` of a DSA layer: the indexer's keys (as keys and as values, as the indexer appends them)."""

    def __init__(self, layer: DSALatentCache) -> None:
        self._layer = layer

    @property
    def offset(self) -> int | mx.array:
        """Positions before the pending step (the indexer ropes its keys here, as mlx-lm's own index cache)."""
        lego, pending = self._layer.lego, self._layer._pending
        n = pending.length if pending is not None else 0
        return batch_positions(lego.offset - n, [o - n for o in lego.row_offsets], self._layer._batch_face)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        read = self._layer._commit(keys)
        return read, read

    @property
    def keys(self) -> mx.array | None:
        return self._layer._reads[2]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._layer._assign(2, value)

    @property
    def values(self) -> mx.array | None:
        return self._layer._reads[3]

    @values.setter
    def values(self, value: mx.array) -> None:
        self._layer._assign(3, value)  # the indexer zeroes it every step; nothing is stored there

    @property
    def state(self) -> list[mx.array]:
        return self._layer.state


class DSALatentCache(LatentLayer):
    """A DSA layer's latent, RoPE key and indexer keys in one latent lego (see the module docstring)."""

    def __init__(self, lego: Any, dtype: mx.Dtype | None = None) -> None:
        if not lego.geometry.has_index:
            raise InvalidCacheState("a DSA layer needs a latent lego with an index family (index_head_dim)")
        super().__init__(lego, dtype)
        self._pending: _Pending | None = None
        self._planes: _PlanesStep | None = None
        self._reads: list[mx.array | None] = [None] * 4
        self.caches = (_LatentFace(self), _IndexFace(self))

    def __getitem__(self, idx: int) -> Any:
        return self.caches[idx]

    def _changed(self) -> None:
        self._require_settled("change its rows")
        self._reads = [None] * 4
        self._planes = None

    def _take_contents_of(self, other: Any) -> None:
        super()._take_contents_of(other)
        self.caches = (_LatentFace(self), _IndexFace(self))
        self._reads = [None] * 4
        self._planes = None

    def _require_settled(self, what: str) -> None:
        if self._pending is not None:
            raise InvalidCacheState(
                f"cannot {what}: this DSA layer holds a step whose indexer keys have not arrived (cache[1]."
                "update_and_fetch must follow cache[0].update_and_fetch)"
            )

    def stored_lego(self) -> Any:
        self._require_settled("persist or batch it")
        return self.lego

    @property
    def state(self) -> list[mx.array]:
        self._require_settled("read its state")
        return self.lego.state

    def _assign(self, i: int, value: mx.array) -> None:
        current = self._reads[i]
        if current is None or not isinstance(value, mx.array) or value.shape != current.shape:
            raise InvalidCacheState("a DSA latent cache takes back only an array shaped like its last read")
        self._reads[i] = value  # mlx-lm chains mx.depends / zeroes through these; the stored state is the lego's

    # -- the two calls of one step -----------------------------------------------------------------------------
    def _stage(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._require_settled("append again")
        g = self.lego.geometry
        latent = heads_of_one("latent (keys)", keys, g.kv_lora_rank)
        rope = heads_of_one("rope key (values)", values, g.rope_head_dim)
        batch, length = latent.shape[0], latent.shape[1]
        self.dtype = self.dtype or keys.dtype
        self._planes = None
        converted = getattr(self.lego, "converted", None)  # f32-first legos say which rows still read f32
        if length == 1 and self._planes_possible(converted):
            return self._stage_on_planes(latent, rope)
        shadow_rows = None
        index_before = None
        if converted is not None and self.lego.batch_size is not None and not all(converted):
            shadow_rows = [not c for c in converted]
            index_before = self.lego.read_latent().index_keys
        elif converted is not None and self.lego.batch_size is None:
            shadow_rows = [True] * batch  # a fresh f32-first lego reads its first append from the shadow
        leads = prefill_leads(self.lego.row_offsets) if self.lego.batch_size is not None else [0] * batch
        state = self.lego.append_latent(latent, rope, mx.zeros((batch, length, g.index_head_dim), dtype=F32))
        self._pending = _Pending(latent, rope, length, shadow_rows, index_before, leads)
        self._reads = [self._as_model(state.latent), self._as_model(state.rope), None, None]
        return self._reads[0], self._reads[1]

    def _planes_possible(self, converted: list[bool] | None) -> bool:
        """Whether a decode step may go on the planes: every row already reads its planes (or the lego has no
        f32-first rows) and the lego stores without decoding."""
        return (self.attend_on_planes and hasattr(self.lego, "store_latent") and self.lego.batch_size is not None
                and (converted is None or all(converted)))

    def _stage_on_planes(self, latent: mx.array, rope: mx.array) -> tuple[mx.array, mx.array]:
        batch, g = latent.shape[0], self.lego.geometry
        reads = self.lego.store_latent(latent, rope, mx.zeros((batch, 1, g.index_head_dim), dtype=F32))
        self._pending = _Pending(latent, rope, 1, None, None, [0] * batch)
        if not reads.on_planes:  # a float32 lego (or a format that does not pack): its reads, as append_latent's
            self._reads = [self._as_model(reads.latent), self._as_model(reads.rope), None, None]
            return self._reads[0], self._reads[1]
        install_latent_attention()
        columns = mx.arange(reads.width, dtype=mx.int32).reshape(1, 1, reads.width, 1)
        self._planes = _PlanesStep(mx.broadcast_to(columns, (batch, 1, reads.width, 1)))
        self._reads = [self._planes.placeholder, None, None, None]  # the RoPE read is the model's to drop
        return self._planes.placeholder, self._as_model(reads.rope)

    def attend_latent_placeholder(self, queries: mx.array, keys: Any, scale: float, mask: Any) -> mx.array | None:
        """mlx-lm's absorbed decode attention when ``keys`` is this step's placeholder or mlx-lm's gather of it
        (see the module docstring); None for anything else (mlx-lm's own attention then runs)."""
        step = self._planes
        if step is None or step.reads is None or not isinstance(keys, mx.array):
            return None
        if keys is step.placeholder:
            out = LatentKeys(step.reads, queries.shape[0], queries.shape[-1], self.dtype).attend(queries, scale, mask)
        else:
            B = step.placeholder.shape[0]
            if keys.dtype != mx.int32 or keys.ndim != 4 or keys.shape[0] != B or keys.shape[1] != 1 \
                    or keys.shape[3] != 1 or queries.shape[2] != 1:
                return None
            mask = None if isinstance(mask, str) else mask
            out = attend_gathered(step.reads.plane_rows(), step.reads.pads, keys[:, 0, :, 0], queries, scale, mask,
                                  self.dtype).astype(queries.dtype)
        # The step's reads have been used (mlx-lm chained them with mx.depends before attending): the index read
        # (and the zeros the indexer assigned beside it) would otherwise stay held until the next step.
        self._reads = [step.placeholder, None, None, None]
        return out

    def _commit(self, keys: mx.array) -> mx.array:
        pending = self._pending
        if pending is None:
            raise InvalidCacheState("the indexer keys of a DSA layer arrive after its latent (cache[0]) each step")
        index = heads_of_one("indexer keys", keys, self.lego.geometry.index_head_dim)
        if index.shape[:2] != pending.latent.shape[:2]:
            raise InvalidCacheState(f"indexer keys {list(keys.shape)} do not match the step's latent rows and length")
        self.lego.trim(pending.length)
        self._pending = None
        if self._planes is not None:  # rows converted before the step stay converted: the re-append is on planes
            self._planes.reads = self.lego.store_latent(pending.latent, pending.rope, index)
            self._reads[2] = self._reads[3] = self._as_model(self._planes.reads.index_keys)
            return self._reads[2]
        read = self.lego.append_latent(pending.latent, pending.rope, index).index_keys
        if pending.shadow_rows is not None and any(pending.shadow_rows):
            fresh = zero_prefill_leads([index], pending.leads)[0]
            shadow = fresh if pending.index_before is None else mx.concatenate([pending.index_before, fresh], axis=1)
            pick = mx.array(pending.shadow_rows)[:, None, None]
            read = mx.where(pick, shadow, read)
        self._reads[2] = self._reads[3] = self._as_model(read)
        return self._reads[2]

    # -- mlx-lm's CacheList names ------------------------------------------------------------------------------
    def trim(self, n: int) -> int:
        self._require_settled("trim it")
        return super().trim(n)

    def merge_rows(self, rows: Sequence[Any]) -> None:
        for row in rows:
            if isinstance(row, DSALatentCache):
                row._require_settled("batch it")
        super().merge_rows(rows)


__all__ = ["DSALatentCache"]
