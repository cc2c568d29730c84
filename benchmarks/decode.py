"""Measure 14: the latent legos at decode speed.

A serving process appends one position per layer per generated token and reads every stored position back, so a
cache's append + read + ``mx.eval`` is the decode loop's hot path. One layer, ``kv_lora_rank`` 512 + rope 64,
float32, one row, a cache holding T tokens (one prefill append), then ``STEPS`` single-position appends each
followed by ``mx.eval`` of what it returned; the figure is the time per step. Every variant of one length is
measured in the same repetition, one after the other (interleaved), and medians are compared.

Baselines in the same run:

* ``MLACache`` and ``PagedLatentCache(format=None)`` against mlx-lm's ``KVCache.update_and_fetch`` on the same
  bytes (keys ``[1, 1, T, 512]``, values ``[1, 1, T, 64]`` float32): target ≤ 1.2×.
* ``EncodedLatentCache`` / paged affine 8 and turbo k8 (converted rows) against ``MLACache``'s step plus a bare
  decode of the same stored planes (``mx.dequantize`` / the TurboQuant key decode) in one eval: target ≤ 1.2×.
* the encoded legos with their decoded read buffer on (``read_buffer=True``) against ``MLACache``'s step: ≤ 2×
  at 16k and 32k.
* memory: the encoded legos' held bytes (capacity included) against the bytes of their encoded planes: default
  ≤ 1.1×, with the read buffer reported.

Then the end-to-end effect: the synthetic GLM-style model (``SyntheticMLAModel``, 4 layers) decoding greedily
from caches holding 4k and 16k positions, tokens per second. ``model_decode`` only uses the public cache API, so
the same function measures an older checkout (``PYTHONPATH`` pointing at it) for a before/after figure.
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .harness import Row, Sample

MEASURE = "14"
RANK, ROPE = 512, 64
LENGTHS = {"small": (256, 1024)}
DEFAULT_LENGTHS = (1024, 4096, 16384, 32768)
MODEL_LENGTHS = {"small": (512,)}
DEFAULT_MODEL_LENGTHS = (4096, 16384)
STEPS = 32


def _families(tokens: int, seed: int) -> list[mx.array]:
    keys = mx.random.split(mx.random.key(seed), 2)
    out = [mx.random.normal((1, tokens, RANK), key=keys[0]), mx.random.normal((1, tokens, ROPE), key=keys[1])]
    mx.eval(out)
    return out


def _has_read_buffer() -> bool:
    from kvshelf.latent_legos.latent.encoded import EncodedLatentCache

    return "read_buffer" in inspect.signature(EncodedLatentCache).parameters


class Variant:
    """One thing measured at one length: ``make(prefill)`` builds its state, ``step(state, step_inputs)`` returns
    the arrays one decode step evaluates."""

    def __init__(self, name: str, make: Callable[[list[mx.array]], Any], step: Callable[[Any, list[mx.array]], list]):
        self.name, self.make, self.step = name, make, step


def _kv_variant() -> Variant:
    def make(prefill):
        from mlx_lm.models.cache import KVCache

        cache = KVCache()
        cache.update_and_fetch(prefill[0][:, None], prefill[1][:, None])
        return cache

    def step(cache, x):
        return list(cache.update_and_fetch(x[0][:, None], x[1][:, None]))

    return Variant("mlx-lm KVCache", make, step)


def _lego_step(cache, x):
    state = cache.append_latent(x[0], x[1])
    return [state.latent, state.rope]


def _lego_variant(name: str, factory: Callable[[], Any]) -> Variant:
    def make(prefill):
        cache = factory()
        cache.append_latent(*prefill)
        return cache

    return Variant(name, make, _lego_step)


SPARE = 4096  # positions of bare-decode planes beyond the prefill: more than any run appends


def _bare_decode_variant(name: str, fmt) -> Variant:
    """``MLACache``'s step plus a bare decode of the planes an encoded cache would hold at this length: planes
    encoded once for the prefill plus ``SPARE`` positions, decoded each step over the MLACache's stored length (a
    view, as the encoded lego's own read is), so both sides decode the same number of positions every step."""
    from kvshelf.latent_legos.encodings import family_encoding
    from kvshelf.latent_legos.latent.geometry import LatentGeometry
    from kvshelf.latent_legos.latent.mla import MLACache

    encodings = [family_encoding(fmt, RANK), family_encoding(fmt, ROPE)]

    def make(prefill):
        cache = MLACache(LatentGeometry(RANK, ROPE))
        cache.append_latent(*prefill)
        spare = _families(SPARE, seed=7)
        planes = [enc.encode(mx.concatenate([values, more], axis=1))
                  for enc, values, more in zip(encodings, prefill, spare)]
        mx.eval(planes)
        return cache, planes

    def step(state, x):
        cache, planes = state
        read = _lego_step(cache, x)
        width = cache.offset
        return read + [enc.decode([p[:, :width, :] for p in family]) for enc, family in zip(encodings, planes)]

    return Variant(name, make, step)


def _variants() -> tuple[list[Variant], dict[str, tuple[str, str, float, tuple[int, ...]]]]:
    """The variants and, per measured lego, (its baseline, target text, limit, lengths the limit applies to)."""
    from kvshelf.latent_legos.latent.encoded import EncodedLatentCache
    from kvshelf.latent_legos.formats import AffineFormat, TurboFormat
    from kvshelf.latent_legos.latent.geometry import LatentGeometry
    from kvshelf.latent_legos.latent.mla import MLACache
    from kvshelf.latent_legos.latent.paged import PagedLatentCache

    geometry = LatentGeometry(RANK, ROPE)
    formats = {"affine8": AffineFormat(8, 64), "turbo k8": TurboFormat(8, 3)}
    every = (0,)
    variants = [_kv_variant(), _lego_variant("MLACache", lambda: MLACache(geometry)),
                _lego_variant("paged f32", lambda: PagedLatentCache(geometry, None, 256))]
    compare = {"MLACache": ("mlx-lm KVCache", "≤ 1.2×", 1.2, every),
               "paged f32": ("mlx-lm KVCache", "≤ 1.2×", 1.2, every)}
    buffered = _has_read_buffer()
    for label, fmt in formats.items():
        base = f"MLACache + bare decode ({label})"
        variants.append(_bare_decode_variant(base, fmt))
        variants.append(_lego_variant(f"encoded {label}", lambda fmt=fmt: EncodedLatentCache(geometry, fmt)))
        variants.append(_lego_variant(f"paged {label}", lambda fmt=fmt: PagedLatentCache(geometry, fmt, 256)))
        compare[f"encoded {label}"] = (base, "≤ 1.2×", 1.2, every)
        compare[f"paged {label}"] = (base, "≤ 1.2×", 1.2, every)
        if buffered:
            name = f"encoded {label} read buffer"
            variants.append(_lego_variant(
                name, lambda fmt=fmt: EncodedLatentCache(geometry, fmt, read_buffer=True)))
            compare[name] = ("MLACache", "≤ 2× at 16k, 32k", 2.0, (16384, 32768))
    return variants, compare


def _time_steps(variant: Variant, state: Any, inputs: list[list[mx.array]]) -> float:
    """Seconds per decode step over ``inputs`` (each step: append, read, ``mx.eval`` of what it returned)."""
    t0 = time.perf_counter()
    for x in inputs:
        out = variant.step(state, x)
        mx.eval(out)
        del out
    return (time.perf_counter() - t0) / len(inputs)


def _arrays(state: Any) -> list[mx.array]:
    """Every array a variant's state holds (so the prefill is evaluated before timing)."""
    if isinstance(state, tuple):
        return [a for part in state for a in _arrays(part)]
    if isinstance(state, list):
        return [a for part in state for a in _arrays(part)]
    if isinstance(state, mx.array):
        return [state]
    return [a for a in state.state if isinstance(a, mx.array)]


def _held_bytes(cache: Any) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    return sum(int(a.nbytes) for a in cache.state)


def step_rows(lengths: tuple[int, ...], reps: int, steps: int = STEPS) -> list[Row]:
    variants, compare = _variants()
    rows: list[Row] = []
    for tokens in lengths:
        prefill = _families(tokens, seed=tokens)
        inputs = [_families(1, seed=10_000 + i) for i in range((reps + 1) * steps)]
        states = {v.name: v.make(prefill) for v in variants}
        mx.eval([_arrays(state) for state in states.values()])
        del prefill
        times: dict[str, list[float]] = {v.name: [] for v in variants}
        for rep in range(reps + 1):  # repetition 0 is the warm-up
            chunk = inputs[rep * steps : (rep + 1) * steps]
            for v in variants:
                seconds = _time_steps(v, states[v.name], chunk)
                if rep:
                    times[v.name].append(seconds * 1e3)
        samples = {name: Sample("ms", reps_ms) for name, reps_ms in times.items()}
        for name, (base, target, limit, applies) in compare.items():
            checked = applies == (0,) or tokens in applies
            rows.append(Row(MEASURE, f"decode step {name} @ {tokens} tok", value=samples[name],
                            baseline=samples[base], baseline_name=base, target=target,
                            limit=limit if checked else None, check="ratio" if checked else "none"))
        rows.extend(_memory_rows(states, tokens))
        del states
        mx.clear_cache()
    return rows


def _memory_rows(states: dict[str, Any], tokens: int) -> list[Row]:
    """Held bytes (capacity included) of each encoded lego against the bytes of its encoded planes."""
    rows = []
    for name, cache in states.items():
        if not name.startswith("encoded"):
            continue
        planes = cache.offset * cache.bytes_per_token()
        held = _held_bytes(cache)
        buffered = name.endswith("read buffer")
        rows.append(Row(MEASURE, f"memory {name} @ {tokens} tok", value=Sample("B", [float(held)]),
                        baseline=Sample("B", [float(planes)]), baseline_name="encoded planes' bytes",
                        target="report" if buffered else "≤ 1.1×", limit=None if buffered else 1.1,
                        check="none" if buffered else "ratio"))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# End to end: the synthetic model


MODEL = {"num_layers": 4, "vocab": 256, "hidden": 256, "num_heads": 4, "kv_lora_rank": RANK, "rope_head_dim": ROPE,
         "index_head_dim": None, "seed": 0}


def _model_caches(model, kind: str):
    from kvshelf.latent_legos import KvScheme

    if kind == "MLACache":
        return model.make_caches()
    if kind == "encoded turbo k8":
        return model.make_caches(KvScheme.turbo(8, 3))
    return model.make_caches(None, paged_block_size=256)


MODEL_KINDS = ("MLACache", "encoded turbo k8", "paged f32")


def model_decode(lengths: tuple[int, ...], reps: int, steps: int = 16) -> dict[str, dict[int, list[float]]]:
    """Per cache kind and length, tokens/s of greedy decoding ``steps`` tokens (one list entry per repetition)."""
    from kvshelf.latent_legos import SyntheticMLAModel

    model = SyntheticMLAModel(**MODEL)
    out: dict[str, dict[int, list[float]]] = {k: {} for k in MODEL_KINDS}
    for tokens in lengths:
        prefill = _families(tokens, seed=tokens)
        setups = {}
        for kind in MODEL_KINDS:
            caches = _model_caches(model, kind)
            for cache in caches:
                cache.append_latent(*prefill)
            mx.eval([c.state for c in caches])
            setups[kind] = caches
        del prefill
        for rep in range(reps + 1):
            for kind in MODEL_KINDS:
                caches = setups[kind]
                token = mx.array([[rep % 256]], dtype=mx.int32)
                t0 = time.perf_counter()
                for _ in range(steps):
                    logits = model(token, caches)
                    token = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
                    mx.eval(token)
                rate = steps / (time.perf_counter() - t0)
                if rep:
                    out[kind].setdefault(tokens, []).append(rate)
        del setups
        mx.clear_cache()
    return out


def model_rows(lengths: tuple[int, ...], reps: int) -> list[Row]:
    rows = []
    for kind, per_length in model_decode(lengths, reps).items():
        for tokens, rates in per_length.items():
            rows.append(Row(MEASURE, f"synthetic model decode ({kind}) @ {tokens} tok", value=Sample("tok/s", rates),
                            target="report", check="none",
                            notes=f"{statistics.median(rates):.1f} tok/s (4 layers, rank {RANK} + rope {ROPE})"))
    return rows


def run(ctx, only: set[str]) -> list[Row]:
    small = ctx.workload.name.startswith("small")
    lengths = LENGTHS["small"] if small else DEFAULT_LENGTHS
    model_lengths = MODEL_LENGTHS["small"] if small else DEFAULT_MODEL_LENGTHS
    rows = step_rows(lengths, ctx.reps, 8 if small else STEPS)
    rows += model_rows(model_lengths, max(1, min(ctx.reps, 3)))
    ctx.facts["decode_lengths"] = list(lengths)
    return rows


if __name__ == "__main__":  # the before/after figure: python -m benchmarks.decode [lengths...]
    import json
    import sys

    chosen = tuple(int(a) for a in sys.argv[1:]) or DEFAULT_MODEL_LENGTHS
    result = model_decode(chosen, 3)
    print(json.dumps({k: {t: statistics.median(r) for t, r in v.items()} for k, v in result.items()}))
