"""Measure 24: compressed latents at decode, attended on their encoded planes (issue 24).

A real mlx-lm ``DeepseekV3Attention`` layer (``kv_lora_rank`` 512 + rope 64, 4 heads, float32 weights) decodes one
token per step over a cache holding T tokens (4k and 16k; filled through the layer's own latent and RoPE
projections), against mlx-lm's own ``KVCache`` in the same run: every variant of one length is timed in the same
repetition, one after the other, and medians are compared.

* decode step time: affine 8 / 4 and turbo k8 / k4 (``EncodedLatentCache`` faces) target ≤ 1.0×; paged turbo k8
  (block 64) ≤ 1.2×; the f32 face (``MLACache``) is reported.
* memory the cache holds after a step (MLX active memory the cache keeps, measured per variant alone) against
  mlx-lm's: 8-bit ≤ 0.35×, 4-bit ≤ 0.2×, paged ≤ 0.45×.
* peak memory of one step above what the cache holds: < one decoded plane (``T × 512 × 4`` bytes); the issue's
  aim is < 1 MiB plus the step's own activations, which the table reports.
* the synthetic model (4 layers) decoding at 16k: turbo k8 against f32 ``MLACache`` tok/s, ≥ 0.9×.
* the longest context that fits a fixed budget: the largest T with ``held(T) + peak of one step(T) <= budget``
  (both fitted linear in T through the two lengths), turbo k8 against the f32 face: ≥ 3× (a report).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import mlx.core as mx

from .harness import Row, Sample

MEASURE = "24"
RANK, ROPE, HEADS, HIDDEN = 512, 64, 4, 256
LENGTHS = {"small": (512, 1024)}
DEFAULT_LENGTHS = (4096, 16384)
STEPS = 16
BUDGET = 1 << 30  # the fixed memory budget of the longest-context figure


def attention_layer():
    from mlx_lm.models import deepseek_v3

    args = deepseek_v3.ModelArgs(
        model_type="deepseek_v3", vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=RANK, q_lora_rank=None, qk_rope_head_dim=ROPE,
        v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1, first_k_dense_replace=1,
        max_position_embeddings=1 << 17, rms_norm_eps=1e-6, attention_bias=False, rope_theta=10000.0,
    )
    mx.random.seed(0)
    layer = deepseek_v3.DeepseekV3Attention(args)
    mx.eval(layer.parameters())
    return layer


def _faces() -> dict[str, Any]:
    """Variant name -> a factory of the cache mlx-lm's attention runs on."""
    from mlx_lm.models.cache import KVCache

    from kvshelf.latent_legos.latent.encoded import EncodedLatentCache
    from kvshelf.latent_legos.formats import AffineFormat, TurboFormat
    from kvshelf.latent_legos.latent.geometry import LatentGeometry
    from kvshelf.latent_legos.latent.mla import MLACache
    from kvshelf.latent_legos.latent.paged import PagedLatentCache
    from kvshelf.mlx_lm.latent.attention import install
    from kvshelf.mlx_lm.latent.faces import MLALatentCache

    install()
    g = LatentGeometry(RANK, ROPE)
    return {
        "mlx-lm KVCache": KVCache,
        "f32 (MLACache)": lambda: MLALatentCache(MLACache(g)),
        "affine 8": lambda: MLALatentCache(EncodedLatentCache(g, AffineFormat(8, 64))),
        "affine 4": lambda: MLALatentCache(EncodedLatentCache(g, AffineFormat(4, 64))),
        "turbo k8": lambda: MLALatentCache(EncodedLatentCache(g, TurboFormat(8, 3))),
        "turbo k4": lambda: MLALatentCache(EncodedLatentCache(g, TurboFormat(4, 3))),
        "paged turbo k8": lambda: MLALatentCache(PagedLatentCache(g, TurboFormat(8, 3), 64)),
    }


STEP_TARGETS = {"affine 8": ("≤ 1.0×", 1.0), "affine 4": ("≤ 1.0×", 1.0), "turbo k8": ("≤ 1.0×", 1.0),
                "turbo k4": ("≤ 1.0×", 1.0), "paged turbo k8": ("≤ 1.2×", 1.2), "f32 (MLACache)": ("report", None)}
HELD_TARGETS = {"affine 8": 0.35, "turbo k8": 0.35, "affine 4": 0.2, "turbo k4": 0.2, "paged turbo k8": 0.45}


def _fill(layer, cache, tokens: int) -> None:
    """``tokens`` positions through the layer's own latent and RoPE projections (what a prefill stores)."""
    chunk = 4096
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        x = mx.random.normal((1, n, HIDDEN), key=mx.random.key(start))
        kv = layer.kv_a_proj_with_mqa(x)
        latent, k_pe = mx.split(kv, [RANK], axis=-1)
        k_pe = layer.rope(k_pe.reshape(1, n, 1, ROPE).transpose(0, 2, 1, 3), start)
        cache.update_and_fetch(mx.expand_dims(layer.kv_a_layernorm(latent), 1), k_pe)
        mx.eval(cache.state)


def _step(layer, cache, seed: int) -> mx.array:
    return layer(mx.random.normal((1, 1, HIDDEN), key=mx.random.key(seed)), mask=None, cache=cache)


def _settled() -> int:
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


def memory_of(layer, factory, tokens: int, fill=_fill) -> tuple[int, int]:
    """(bytes the cache holds after a decode step, peak bytes of one step above that), the variant alone."""
    mx.clear_cache()
    before = _settled()
    cache = factory()
    fill(layer, cache, tokens)
    for i in range(2):
        mx.eval(_step(layer, cache, 90 + i))
    held = _settled() - before
    mx.reset_peak_memory()
    out = _step(layer, cache, 99)
    mx.eval(out, cache.state)
    peak = mx.get_peak_memory() - before - held
    del out, cache
    return held, peak


def step_rows(lengths: tuple[int, ...], reps: int, steps: int = STEPS) -> tuple[list[Row], dict]:
    layer, faces = attention_layer(), _faces()
    rows: list[Row] = []
    facts: dict[str, dict[int, tuple[int, int]]] = {name: {} for name in faces}
    base = "mlx-lm KVCache"
    for tokens in lengths:
        for name, factory in faces.items():
            facts[name][tokens] = memory_of(layer, factory, tokens)
        mx.clear_cache()
        caches = {}
        for name, factory in faces.items():
            caches[name] = factory()
            _fill(layer, caches[name], tokens)
        times: dict[str, list[float]] = {name: [] for name in faces}
        for rep in range(reps + 1):  # repetition 0 is the warm-up
            for name, cache in caches.items():
                t0 = time.perf_counter()
                for i in range(steps):
                    mx.eval(_step(layer, cache, rep * steps + i))
                if rep:
                    times[name].append((time.perf_counter() - t0) / steps * 1e3)
        samples = {name: Sample("ms", t) for name, t in times.items()}
        for name, (target, limit) in STEP_TARGETS.items():
            rows.append(Row(MEASURE, f"decode step {name} @ {tokens} tok", value=samples[name],
                            baseline=samples[base], baseline_name=base, target=target, limit=limit,
                            check="ratio" if limit else "none"))
        kv_held = facts[base][tokens][0]
        plane = tokens * RANK * 4
        for name in STEP_TARGETS:
            held, peak = facts[name][tokens]
            limit = HELD_TARGETS.get(name)
            rows.append(Row(MEASURE, f"memory held after a step {name} @ {tokens} tok",
                            value=Sample("B", [float(held)]), baseline=Sample("B", [float(kv_held)]),
                            baseline_name=base, target=f"≤ {limit}×" if limit else "report", limit=limit,
                            check="ratio" if limit else "none"))
            rows.append(Row(MEASURE, f"peak of one step above the cache {name} @ {tokens} tok",
                            value=Sample("B", [float(peak)]), baseline=Sample("B", [float(plane)]),
                            baseline_name="one decoded plane (T x 512 x 4 B)", target="< 1× (aim: < 1 MiB + the "
                            "step's activations)", limit=1.0 if name in HELD_TARGETS else None,
                            check="ratio" if name in HELD_TARGETS else "none",
                            notes=f"{peak / 2**20:.2f} MiB; mlx-lm KVCache {facts[base][tokens][1] / 2**20:.2f} MiB"))
        del caches
        mx.clear_cache()
    return rows, facts


def longest_context(facts: dict, name: str, lengths: tuple[int, ...]) -> float:
    """The longest context T whose cache plus one decode step's peak fits ``BUDGET``: ``held(T) + peak(T) <= BUDGET``.

    Both are measured at two lengths; their sum is fitted as ``a + b·T`` through those two points (what a cache
    holds grows linearly in T; a step's peak is a constant — the step's own activations — plus whatever grows with
    T), so a constant part is not scaled up with the context as a per-token ratio would.
    """
    short, long = lengths[0], lengths[-1]
    cost = {t: sum(max(v, 0) for v in facts[name][t]) for t in (short, long)}
    slope = (cost[long] - cost[short]) / (long - short) if long > short else cost[long] / long
    if slope <= 0:
        return float("inf")
    return (BUDGET - (cost[long] - slope * long)) / slope


def longest_context_rows(facts: dict, lengths: tuple[int, ...]) -> list[Row]:
    """The longest context that fits ``BUDGET`` (``longest_context``): turbo k8 against the f32 face (and mlx-lm)."""
    rows = []
    for base in ("f32 (MLACache)", "mlx-lm KVCache"):
        rows.append(Row(MEASURE, f"longest context in {BUDGET >> 20} MiB turbo k8 vs {base}",
                        value=Sample("tok", [longest_context(facts, "turbo k8", lengths)]),
                        baseline=Sample("tok", [longest_context(facts, base, lengths)]),
                        baseline_name=base, target="≥ 3× (report)", limit=3.0, check="ratio-min",
                        notes=f"held + one step's peak, linear through the {lengths[0]}- and {lengths[-1]}-token "
                              "figures"))
    return rows


INDEX_DIM, INDEX_HEADS, INDEX_TOPK = 128, 4, 2048


def dsa_layer():
    """A real mlx-lm glm_moe_dsa (deepseek_v32) attention layer: rank 512 + rope 64, 4 heads, an indexer of 4 heads
    x 128 selecting the top 2048 positions (glm_moe_dsa's own top-k)."""
    from mlx_lm.models import deepseek_v32

    args = deepseek_v32.ModelArgs(
        model_type="glm_moe_dsa", vocab_size=64, hidden_size=HIDDEN, index_head_dim=INDEX_DIM,
        index_n_heads=INDEX_HEADS, index_topk=INDEX_TOPK, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        n_routed_experts=4, kv_lora_rank=RANK, q_lora_rank=128, qk_rope_head_dim=ROPE, v_head_dim=128,
        qk_nope_head_dim=128, max_position_embeddings=1 << 17, rope_theta=10000.0,
    )
    mx.random.seed(0)
    layer = deepseek_v32.DeepseekV32Attention(args)
    mx.eval(layer.parameters())
    return layer


def _dsa_faces() -> dict[str, Any]:
    from mlx_lm.models.cache import CacheList, KVCache

    from kvshelf.latent_legos.latent.encoded import EncodedLatentCache
    from kvshelf.latent_legos.formats import AffineFormat, TurboFormat
    from kvshelf.latent_legos.latent.geometry import LatentGeometry
    from kvshelf.mlx_lm.latent.attention import install
    from kvshelf.mlx_lm.latent.dsa import DSALatentCache

    install()
    g = LatentGeometry(RANK, ROPE, index_head_dim=INDEX_DIM)
    return {
        "mlx-lm CacheList(KVCache, KVCache)": lambda: CacheList(KVCache(), KVCache()),
        "affine 8": lambda: DSALatentCache(EncodedLatentCache(g, AffineFormat(8, 64))),
        "affine 4": lambda: DSALatentCache(EncodedLatentCache(g, AffineFormat(4, 64))),
        "turbo k8": lambda: DSALatentCache(EncodedLatentCache(g, TurboFormat(8, 3))),
        "turbo k4": lambda: DSALatentCache(EncodedLatentCache(g, TurboFormat(4, 3))),
        DECODED: lambda: _decoded(DSALatentCache(EncodedLatentCache(g, TurboFormat(8, 3)))),
    }


DECODED = "turbo k8, decode-then-attend (before)"


def _decoded(face):
    face.attend_on_planes = False  # the path every DSA step took before its placeholder: two decoded appends
    return face


def _dsa_fill(layer, cache, tokens: int) -> None:
    """``tokens`` positions through the layer's own latent, RoPE and indexer-key projections (what a prefill
    stores), both of the layer's calls per chunk, as its prefill makes them."""
    chunk = 4096
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        x = mx.random.normal((1, n, HIDDEN), key=mx.random.key(start))
        kv = layer.kv_a_proj_with_mqa(x)
        latent, k_pe = mx.split(kv, [RANK], axis=-1)
        k_pe = layer.rope(k_pe.reshape(1, n, 1, ROPE).transpose(0, 2, 1, 3), start)
        cache[0].update_and_fetch(mx.expand_dims(layer.kv_a_layernorm(latent), 1), k_pe)
        ix = layer.indexer
        k = ix.rope(ix.k_norm(ix.wk(x)).reshape(1, 1, n, INDEX_DIM), offset=start)
        cache[1].update_and_fetch(k, k)
        mx.eval([c.state for c in cache.caches] if hasattr(cache, "caches") else cache.state)


def dsa_rows(lengths: tuple[int, ...], reps: int, steps: int = STEPS) -> list[Row]:
    """glm_moe_dsa's attention layer: decode step time and the peak of one step above the cache, each face against
    mlx-lm's own ``CacheList(KVCache, KVCache)`` on the same layer, interleaved in one run."""
    layer, faces = dsa_layer(), _dsa_faces()
    base = next(iter(faces))
    rows: list[Row] = []
    for tokens in lengths:
        memory = {name: memory_of(layer, factory, tokens, _dsa_fill) for name, factory in faces.items()}
        mx.clear_cache()
        caches = {}
        for name, factory in faces.items():
            caches[name] = factory()
            _dsa_fill(layer, caches[name], tokens)
        times: dict[str, list[float]] = {name: [] for name in faces}
        for rep in range(reps + 1):  # repetition 0 is the warm-up
            for name, cache in caches.items():
                t0 = time.perf_counter()
                for i in range(steps):
                    mx.eval(_step(layer, cache, rep * steps + i))
                if rep:
                    times[name].append((time.perf_counter() - t0) / steps * 1e3)
        samples = {name: Sample("ms", t) for name, t in times.items()}
        plane = tokens * RANK * 4
        for name in faces:
            if name == base:
                continue
            limit = None if name == DECODED else 1.0
            rows.append(Row(MEASURE, f"glm_moe_dsa decode step {name} @ {tokens} tok", value=samples[name],
                            baseline=samples[base], baseline_name=base, target="≤ 1.0×" if limit else "report",
                            limit=limit, check="ratio" if limit else "none",
                            notes=f"top-{INDEX_TOPK} sparse selection"))
            held, peak = memory[name]
            rows.append(Row(MEASURE, f"glm_moe_dsa peak of one step above the cache {name} @ {tokens} tok",
                            value=Sample("B", [float(peak)]), baseline=Sample("B", [float(plane)]),
                            baseline_name="one decoded plane (T x 512 x 4 B)", target="< 1×" if limit else "report",
                            limit=limit, check="ratio" if limit else "none", notes=f"{peak / 2**20:.2f} MiB; mlx-lm {memory[base][1] / 2**20:.2f} MiB; "
                            f"held {held / 2**20:.2f} MiB vs mlx-lm {memory[base][0] / 2**20:.2f} MiB"))
        del caches
        mx.clear_cache()
    return rows


def model_rows(tokens: int, reps: int) -> list[Row]:
    from .decode import model_decode

    rates = model_decode((tokens,), reps)
    return [Row(MEASURE, f"synthetic model decode turbo k8 vs f32 MLACache @ {tokens} tok",
                value=Sample("tok/s", rates["encoded turbo k8"][tokens]),
                baseline=Sample("tok/s", rates["MLACache"][tokens]), baseline_name="MLACache (f32)",
                target="≥ 0.9×", limit=0.9, check="ratio-min", notes="4 layers, rank 512 + rope 64")]


def run(ctx, only: set[str]) -> list[Row]:
    small = ctx.workload.name.startswith("small")
    lengths = LENGTHS["small"] if small else DEFAULT_LENGTHS
    rows, facts = step_rows(lengths, ctx.reps, 4 if small else STEPS)
    rows += longest_context_rows(facts, lengths)
    rows += dsa_rows(lengths, ctx.reps, 4 if small else STEPS)
    rows += model_rows(lengths[-1], max(1, min(ctx.reps, 3)))
    ctx.facts["decode_planes_lengths"] = list(lengths)
    return rows
