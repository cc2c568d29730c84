"""kvshelf for mlx-lm users: mlx-lm's own caches persist as they are, kvshelf's latent legos run inside mlx-lm's
MLA models, and mlx-lm's prompt-cache files go both ways.

Nothing here is needed to save mlx-lm caches: with mlx-lm installed, ``store.save(sid, tokens,
make_prompt_cache(model))`` works through the codecs this package registers (entry point ``kvshelf.codecs``), and
restores give back the same mlx-lm classes. This package adds ``make_prompt_cache`` (latent legos in MLA layers)
and the file bridge (``import_prompt_cache``, ``export_prompt_cache``, ``read_prompt_cache``,
``write_prompt_cache``). It depends on kvshelf's core and mlx-lm; the core never imports it.
"""

from .files import (
    PromptCacheFile,
    as_mlx_lm,
    export_prompt_cache,
    import_prompt_cache,
    is_prompt_cache_file,
    read_prompt_cache,
    write_prompt_cache,
)
from .latent.cache import make_prompt_cache

__all__ = [
    "PromptCacheFile",
    "as_mlx_lm",
    "export_prompt_cache",
    "import_prompt_cache",
    "is_prompt_cache_file",
    "make_prompt_cache",
    "read_prompt_cache",
    "write_prompt_cache",
]

# --- serving: the tiered prompt cache, model identity, `kvshelf serve` ------------------------------------------
from .serve.model_identity import model_identity
from .serve.prompt_cache import TieredPromptCache

__all__ += ["TieredPromptCache", "model_identity"]

# --- generations that survive a crash: stream_generate with checkpoints (docs/RESUMING.md) ----------------------
from .resumable import resumable_generate

__all__ += ["resumable_generate"]

# --- checkpoints while prefilling (docs/CHECKPOINTS.md) ----------------------------------------------------------
from .prefix_checkpoints import Collector as CheckpointCollector, prefill

__all__ += ["CheckpointCollector", "prefill"]
