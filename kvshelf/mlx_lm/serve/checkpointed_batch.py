"""mlx-lm's ``BatchGenerator`` whose rows can be generation checkpoints and resumes (``batch_rows.py``).

Why a subclass handed to mlx-lm's loop: ``ResponseGenerator._generate`` builds its batch with the name
``BatchGenerator`` of ``mlx_lm.server`` and then only calls ``insert_segments``, ``next``, ``extract_cache``,
``remove``, ``prompt_cache_nbytes`` and ``close``. While ``kvshelf serve`` runs, that name is this class (bound to the
server's :class:`~kvshelf.mlx_lm.serve.batch_rows.BatchRows` by ``batch_generator_class``), so the loop, its
scheduling, its detokenizing and its prompt-cache inserts stay mlx-lm's own; the three overrides below only hand the
rows to ``BatchRows`` (claim an insert, see each step's responses, forget removed rows).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from .batch_rows import BatchRows

log = logging.getLogger("kvshelf.serve")


class CheckpointedBatchGenerator(BatchGenerator):
    """``BatchGenerator(model, **options)`` with ``rows`` (the server's checkpointed rows)."""

    def __init__(self, model: Any, *, rows: BatchRows, **options: Any):
        super().__init__(model, **options)
        self.rows = rows

    def insert_segments(self, segments, max_tokens=None, caches=None, all_tokens=None, samplers=None,
                        logits_processors=None, stop_sequences=None):
        try:
            claimed = self.rows.claim(segments, all_tokens, samplers, stop_sequences, max_tokens, caches)
        except Exception as exc:  # noqa: BLE001 - mlx-lm's loop has no handler here: serve it as mlx-lm would
            log.warning("kvshelf generation checkpoints off for a request: %s: %s", type(exc).__name__, exc)
            claimed = None
        if claimed is None:
            return super().insert_segments(segments, max_tokens, caches, all_tokens, samplers, logits_processors,
                                           stop_sequences)
        row, inputs = claimed
        uids = super().insert_segments(inputs["segments"], inputs["max_tokens"], inputs["caches"],
                                       inputs["all_tokens"], inputs["samplers"], logits_processors,
                                       inputs["stop_sequences"])
        self.rows.started(uids[0], row)
        return uids

    def next(self):
        prompt_responses, generated = super().next()
        with mx.stream(self.stream):
            return prompt_responses, self.rows.after_step(self, generated)

    def remove(self, uids, return_prompt_caches=False):
        self.rows.removed(list(uids))
        return super().remove(uids, return_prompt_caches)


def batch_generator_class(rows: BatchRows) -> Any:
    """What ``mlx_lm.server.BatchGenerator`` is while ``kvshelf serve`` runs: mlx-lm's loop calls it as it would the
    class."""
    return functools.partial(CheckpointedBatchGenerator, rows=rows)


__all__ = ["CheckpointedBatchGenerator", "batch_generator_class"]
