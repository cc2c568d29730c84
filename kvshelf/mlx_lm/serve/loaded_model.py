"""Every array a loaded model holds, evaluated in the thread that loaded it.

Why: ``kvshelf serve`` loads the default model in the main thread, before the HTTP server listens (``startup.py``:
a model that does not load is a start-up error, not a dead generation thread), while mlx-lm generates in its own
thread. MLX streams are per thread, and ``mlx_lm.load`` evaluates the parameters only: arrays a model builds in its
constructor outside them (Llama 3.1's scaled RoPE frequencies ``_freqs``, Muse Spark's vision RoPE ``_inv_freq``)
stay lazy, bound to the loading thread's stream, and the generation thread's first forward fails with "There is no
Stream(cpu, 0) in current thread" (the thread dies; plain ``mlx_lm.server`` loads in the generation thread and never
sees it). Evaluating them here makes them plain data any thread can read.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


def settle_arrays(model: Any) -> int:
    """Evaluate every ``mx.array`` held by ``model``'s modules (parameters and private attributes alike); how many."""
    if model is None or not hasattr(model, "modules"):
        return 0
    arrays = [v for _k, v in tree_flatten(model.parameters()) if isinstance(v, mx.array)]
    for module in model.modules():
        # mlx's Module is a dict: arrays (private ones too) are its items; other attributes are in __dict__
        for value in [*module.values(), *vars(module).values()]:
            if isinstance(value, mx.array):
                arrays.append(value)
            elif isinstance(value, (list, tuple)):
                arrays.extend(v for v in value if isinstance(v, mx.array))
    mx.eval(arrays)
    return len(arrays)


__all__ = ["settle_arrays"]
