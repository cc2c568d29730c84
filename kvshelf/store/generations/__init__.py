"""Generation checkpoints: what a server was generating, saved at step boundaries so an identical retried request
resumes with exactly the text an uninterrupted run gives (docs/RESUMING.md).

Not the *prefix checkpoints* of ``save/checkpoints.py`` (states along a stored prompt, docs/CHECKPOINTS.md): a
generation checkpoint is a snapshot in a reserved namespace keyed by the request's continuation key, built only on
the store's public calls, which its collaborator receives (``checkpoints.GenerationCheckpoints``).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.admin``,
``store.remote``, ``store.integrity``, ``store.restore``, ``store.save``, ``store.space``, ``store.liveness``,
``store.prefix``, ``store.index``, ``store.objects``, ``store.context``, ``store.identity``, ``store.inputs``,
``store.results``, ``store.base``; and ``kvshelf.errors``. Never a room above it, nor the façade."""

from .checkpoints import NAMESPACE_PREFIX, GenerationCheckpoint, GenerationCheckpoints, continuation_key

__all__ = ["NAMESPACE_PREFIX", "GenerationCheckpoint", "GenerationCheckpoints", "continuation_key"]
