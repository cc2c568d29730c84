"""The faces mlx-lm's MLA attention code sees when kvshelf's latent legos hold its state.

mlx-lm keeps an MLA layer's compressed state in a ``KVCache``: the normalized latent as keys ``[B, 1, L, r]`` and
the RoPE key as values ``[B, 1, L, d]``; glm_moe_dsa (deepseek_v32) makes each layer a ``CacheList`` whose second
``KVCache`` holds the sparse-attention indexer's keys. ``make_prompt_cache`` returns, per layer, a cache that this
attention code runs on unchanged while the state lives in an ``MLACache`` (float32), an f32-first
``EncodedLatentCache`` (affine / TurboQuant, converting at ``quantized_kv_start``) or a ``PagedLatentCache``.

* ``MLALatentCache`` is the ``KVCache`` face: ``update_and_fetch(latent, rope)`` appends to the lego and returns
  its reads as ``[B, 1, T, w]`` in the model's dtype (float32 reads of float32 storage are the appended bits, so
  an f32 lego is bit-identical to mlx-lm's ``KVCache``).
* ``DSALatentCache`` (``latent_dsa``) is the ``CacheList`` face of a DSA layer.

Both offer what mlx-lm calls: ``offset`` (per-row positions to mlx-lm code reading a batch, see
``kvshelf.latent_legos.kv.model_face``), ``state``, ``meta_state``, ``is_trimmable``/``trim`` (clamped, as
mlx-lm), ``make_mask``, ``size``/``empty``/``nbytes``, assignable ``keys``/``values`` (mlx-lm re-assigns them to
chain ``mx.depends``; the stored state is unaffected) and ``BatchGenerator``'s ``merge``/``extend``/``filter``/
``extract``/``prepare``/``finalize``. mlx-lm's ``save_prompt_cache`` cannot write them (its loader only knows its
own classes): persist through a kvshelf store or snapshot file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ...errors import InvalidCacheState
from ...latent_legos.contracts import LatentAttentionState
from ...latent_legos.kv.masks import attention_mask
from ...latent_legos.kv.model_face import MlxLmBatchFace, batch_positions
from .attention import LatentKeys
from .attention import install as install_latent_attention

F32 = mx.float32
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def dtype_name(dtype: mx.Dtype | None) -> str | None:
    """A model dtype by name (``mx.Dtype`` does not deep-copy, and mlx-lm's ``BatchGenerator`` deep-copies caches)."""
    if dtype is None:
        return None
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise InvalidCacheState(f"MLA reads in {dtype}; kvshelf's latent adapters take float32, bfloat16 or float16")


def heads_of_one(name: str, array: Any, width: int) -> mx.array:
    """``[B, 1, L, width]`` in (mlx-lm's MLA layout) -> float32 ``[B, L, width]``."""
    if not isinstance(array, mx.array) or array.ndim != 4 or array.shape[1] != 1 or array.shape[3] != width:
        got = list(array.shape) if isinstance(array, mx.array) else type(array).__name__
        raise InvalidCacheState(f"{name} must be [B, 1, L, {width}] (mlx-lm's MLA cache layout); got {got}")
    return array[:, 0].astype(F32)


class LatentLayer(MlxLmBatchFace):
    """What both faces share: the lego, the model dtype of reads, row operations and mlx-lm's bookkeeping names.

    ``attend_on_planes`` (default True): a decode step over encoded planes is attended on the planes (see
    ``attention``); False decodes every stored position and hands mlx-lm float32 reads, as before (an A/B switch
    for accuracy and speed comparisons, settable on an instance)."""

    attend_on_planes = True

    def __init__(self, lego: Any, dtype: mx.Dtype | None = None) -> None:
        self.lego = lego
        self._dtype = dtype_name(dtype)

    @property
    def dtype(self) -> mx.Dtype | None:
        """The model dtype reads are handed back in (set by the first append; None before)."""
        return None if self._dtype is None else DTYPES[self._dtype]

    @dtype.setter
    def dtype(self, value: mx.Dtype | None) -> None:
        self._dtype = dtype_name(value)

    def _changed(self) -> None:
        """The rows are about to change outside an append (a subclass drops reads it keeps for ``keys``)."""

    # -- kvshelf's row operations, delegated (MlxLmBatchFace maps mlx-lm's names onto them) ---------------------
    def make_empty_batch(self) -> Any:
        return type(self)(self.lego.make_empty_batch(), self.dtype)

    def merge_rows(self, rows: Sequence[Any]) -> None:
        for row in rows:
            if type(row) is not type(self):
                raise InvalidCacheState(f"cannot batch a {type(row).__name__} with a {type(self).__name__}")
        self.dtype = self.dtype or next((r.dtype for r in rows if r.dtype is not None), None)
        self._changed()
        self.lego.merge_rows([r.stored_lego() for r in rows])

    def extract_row(self, row: int) -> Any:
        return type(self)(self.stored_lego().extract_row(row), self.dtype)

    def filter_rows(self, keep: Sequence[int]) -> None:
        self._changed()
        self.lego.filter_rows(keep)

    def prepare_prefill(self, padding: Any) -> None:
        self._changed()
        self.lego.prepare_prefill(padding)

    def finalize_prefill(self) -> None:
        self._changed()
        self.lego.finalize_prefill()

    @property
    def batch_size(self) -> int | None:
        return self.lego.batch_size

    def stored_lego(self) -> Any:
        """The lego holding this layer's state (what the codecs persist)."""
        return self.lego

    # -- mlx-lm's cache protocol -------------------------------------------------------------------------------
    @property
    def offset(self) -> int | mx.array:
        return batch_positions(self.lego.offset, self.lego.row_offsets, self._batch_face)

    @property
    def state(self) -> list[mx.array]:
        return self.lego.state

    @property
    def meta_state(self) -> tuple[str, str]:
        return self.lego.signature(), self._dtype or ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.lego.state)

    def size(self) -> int:
        return self.lego.offset

    def empty(self) -> bool:
        return self.lego.batch_size is None or self.lego.offset == 0

    def is_trimmable(self) -> bool:
        return self.lego.is_trimmable()

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every row, clamped to the shortest row (mlx-lm's rule)."""
        n = min(int(n), min(self.lego.row_offsets, default=0))
        self._changed()
        return self.lego.trim(n) if n > 0 else 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> Any:
        return attention_mask(N, self.lego.offset, return_array, window_size, self.lego.left_pad)

    def _as_model(self, read: mx.array) -> mx.array:
        return read[:, None].astype(self.dtype or F32)


class MLALatentCache(LatentLayer):
    """The ``KVCache`` face of one MLA layer over a latent lego (see the module docstring); a decode step over
    encoded planes hands mlx-lm ``LatentKeys``."""

    def __init__(self, lego: Any, dtype: mx.Dtype | None = None) -> None:
        super().__init__(lego, dtype)
        self._reads: list[mx.array | None] = [None, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        g = self.lego.geometry
        latent = heads_of_one("latent (keys)", keys, g.kv_lora_rank)
        rope = heads_of_one("rope key (values)", values, g.rope_head_dim)
        self.dtype = self.dtype or keys.dtype
        self._reads = [None, None]  # last step's reads hold views of the buffers: drop them so the append is in place
        if latent.shape[1] == 1 and self.attend_on_planes and hasattr(self.lego, "store_latent"):
            reads = self.lego.store_latent(latent, rope)
            if reads.on_planes or reads.mixed:  # mlx-lm's attention reaches the planes through LatentKeys
                install_latent_attention()
                keys = LatentKeys(reads, latent.shape[0], g.kv_lora_rank, self.dtype)
                self._reads = [keys, None]  # the RoPE read is the model's to drop: nothing decoded stays held here
                return keys, self._as_model(reads.rope)
            state = LatentAttentionState(reads.latent, reads.rope)
        else:
            state = self.lego.append_latent(latent, rope)
        self._reads = [self._as_model(state.latent), self._as_model(state.rope)]
        return self._reads[0], self._reads[1]

    def _read(self, i: int) -> mx.array | None:
        if isinstance(self._reads[0], LatentKeys):
            return self._reads[0].array() if i == 0 else self._as_model(self._reads[0].reads.rope)
        if self._reads[i] is None and not self.empty():
            state = self.lego.read_latent()
            self._reads = [self._as_model(state.latent), self._as_model(state.rope)]
        return self._reads[i]

    def _assign(self, i: int, value: mx.array) -> None:
        if isinstance(self._reads[0], LatentKeys):
            width = self._reads[0].shape[3] if i == 0 else self.lego.geometry.rope_head_dim
            shape = (*self._reads[0].shape[:3], width)
            if not isinstance(value, mx.array) or tuple(value.shape) != shape:
                got = list(value.shape) if isinstance(value, mx.array) else type(value).__name__
                raise InvalidCacheState(f"an MLA latent cache takes back only an array shaped like its read (got {got})")
            return  # the planes are the read; an assigned copy (mlx-lm's mx.depends chain) changes nothing stored
        current = self._read(i)
        if current is None or not isinstance(value, mx.array) or value.shape != current.shape:
            got = list(value.shape) if isinstance(value, mx.array) else type(value).__name__
            raise InvalidCacheState(f"an MLA latent cache takes back only an array shaped like its read (got {got})")
        self._reads[i] = value  # mlx-lm chains mx.depends through this; the stored state is the lego's

    @property
    def keys(self) -> mx.array | None:
        """The latent read of every stored position, ``[B, 1, T, r]`` (mlx-lm's ``keys[..., :offset, :]``)."""
        return self._read(0)

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._assign(0, value)

    @property
    def values(self) -> mx.array | None:
        return self._read(1)

    @values.setter
    def values(self, value: mx.array) -> None:
        self._assign(1, value)

    def _changed(self) -> None:
        self._reads = [None, None]

    def _take_contents_of(self, other: Any) -> None:
        super()._take_contents_of(other)
        self._changed()


__all__ = ["DTYPES", "F32", "LatentLayer", "MLALatentCache", "dtype_name", "heads_of_one"]
