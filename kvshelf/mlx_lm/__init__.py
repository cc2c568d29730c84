"""kvshelf for mlx-lm users: mlx-lm's own caches persist as they are (codecs registered through the
``kvshelf.codecs`` entry point). This package depends on kvshelf's core and mlx-lm; the core never imports it."""

# --- serving (issue 10): the tiered prompt cache, model identity, `kvshelf serve` ---------------------------------
from .model_identity import model_identity
from .prompt_cache import TieredPromptCache

__all__ = ["TieredPromptCache", "model_identity"]
