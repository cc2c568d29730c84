"""The geometry every latent lego of one layer shares (GLM-style compressed MLA)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InvalidCacheState


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidCacheState(f"{name} must be a positive integer (got {value!r})")
    return value


@dataclass(frozen=True, slots=True)
class LatentGeometry:
    """Widths of the stored families and an optional position cap.

    Families in stored order: 0 the latent (``kv_lora_rank``), 1 the decoupled RoPE key (``rope_head_dim``),
    2 the DSA index key (``index_head_dim``, sparse-attention layers only). ``max_tokens`` caps a row's
    positions; ``None`` means unbounded.
    """

    kv_lora_rank: int
    rope_head_dim: int
    index_head_dim: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        _positive(self.kv_lora_rank, "kv_lora_rank")
        _positive(self.rope_head_dim, "rope_head_dim")
        if self.index_head_dim is not None:
            _positive(self.index_head_dim, "index_head_dim")
        if self.max_tokens is not None:
            _positive(self.max_tokens, "max_tokens")

    @property
    def has_index(self) -> bool:
        return self.index_head_dim is not None

    @property
    def widths(self) -> tuple[int, ...]:
        """Family widths in stored order."""
        if self.index_head_dim is None:
            return (self.kv_lora_rank, self.rope_head_dim)
        return (self.kv_lora_rank, self.rope_head_dim, self.index_head_dim)

    @property
    def token_limit(self) -> int:
        """``max_tokens``, or an effectively unbounded cap."""
        return self.max_tokens if self.max_tokens is not None else 2**62

    def f32_bytes_per_token(self) -> int:
        return 4 * sum(self.widths)
