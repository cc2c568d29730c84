"""The ``kvshelf.codecs`` entry point: the codecs of mlx-lm's own cache classes (and kvshelf's latent adapters
inside mlx-lm models when that module is present).

``kvshelf.codecs.provider`` loads this lazily through package metadata, so the core never imports mlx-lm. Importing
this module imports mlx-lm; when mlx-lm is absent that ``ImportError`` (it names ``mlx_lm``) tells the provider to
skip the plugin quietly. A present but unsupported mlx-lm is a clear error instead of codecs that misread it.
"""

from __future__ import annotations

import mlx_lm

from ..errors import IncompatibleFormat

SUPPORTED = ("0.32.",)


def codecs() -> list:
    """Every codec this plugin registers in the default provider."""
    version = getattr(mlx_lm, "__version__", "")
    if not version.startswith(SUPPORTED):
        raise IncompatibleFormat(
            f"kvshelf's mlx-lm codecs support mlx-lm 0.32.x (its cache classes' state layout); found {version!r}"
        )
    from .codecs.kv import TOKEN_CODECS
    from .codecs.cache_list import LIST_CODECS
    from .codecs.state import STATE_CODECS

    found = [*TOKEN_CODECS, *STATE_CODECS, *LIST_CODECS]
    try:
        from .codecs.latent import LATENT_ADAPTER_CODECS
    except ImportError as exc:
        if exc.name != f"{__package__}.codecs.latent":
            raise
    else:
        found += list(LATENT_ADAPTER_CODECS)
    return found


__all__ = ["codecs"]
