"""kvshelf for mlx-lm users. This package depends on kvshelf's core and mlx-lm; the core never imports it."""

from .latent_cache import make_prompt_cache

__all__ = ["make_prompt_cache"]
