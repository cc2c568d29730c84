"""kvshelf's mlx-lm integration (depends on the core, never the reverse)."""

from __future__ import annotations

# --- serving (issue 10): the tiered prompt cache, model identity, `kvshelf serve` ---------------------------------
from .model_identity import model_identity  # noqa: E402
from .prompt_cache import TieredPromptCache  # noqa: E402

__all__ = ["TieredPromptCache", "model_identity"]
