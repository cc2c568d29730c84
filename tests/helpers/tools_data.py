"""Real stores for the tools tests: every latent lego kind, shared prefixes, and the CLI run as a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvshelf import Identity, open_store
from kvshelf.latent_legos import KvScheme, LatentGeometry, composed_latent_cache

MODEL = Identity("tools-test-model", config_fingerprint="cfg-1", tokenizer_hash="tok-1")
OTHER = Identity("other-model", config_fingerprint="cfg-9", tokenizer_hash="tok-9")
GEOMETRY = LatentGeometry(kv_lora_rank=32, rope_head_dim=32, index_head_dim=32)
CHUNK = 32
SCHEMES = {
    "mla": (KvScheme.bf16(), None),
    "affine4": (KvScheme.affine(4, 32), None),
    "affine8-start": (KvScheme.affine(8, 32, quantized_kv_start=48), None),
    "turbo": (KvScheme.turbo(8, 3), None),
    "paged-f32": (KvScheme.bf16(), 16),
    "paged-affine": (KvScheme.affine(4, 32), 16),
}


def make_caches(kind: str, n: int, seed: int, *, trim: int = 0, layers: int = 2) -> list:
    """``layers`` caches of one kind holding ``n`` positions (seeded; ``trim`` extra positions appended then cut, so
    paged pools hold blocks no page uses)."""
    scheme, block = SCHEMES[kind]
    caches = []
    for layer in range(layers):
        cache = composed_latent_cache(scheme, block, layer, GEOMETRY)
        rng = np.random.default_rng([seed, layer])
        total = n + trim
        latent = mx.array(rng.standard_normal((1, total, 32)).astype(np.float32))
        rope = mx.array(rng.standard_normal((1, total, 32)).astype(np.float32))
        index = mx.array(rng.standard_normal((1, total, 32)).astype(np.float32))
        cache.append_latent(latent, rope, index)
        if trim:
            cache.trim(trim)
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def tokens_for(n: int, seed: int) -> list[int]:
    """A shared 40-token system prompt, then seeded tokens."""
    head = list(range(1000, 1040))
    return (head + [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, max(0, n - 40))])[:n]


def reads(caches: list) -> list[np.ndarray]:
    """What the caches read: append one fixed position to copies-by-restore and return every stored position."""
    out = []
    for cache in caches:
        rng = np.random.default_rng(99)
        b = cache.batch_size or 1
        state = cache.append_latent(mx.array(rng.standard_normal((b, 1, 32)).astype(np.float32)),
                                    mx.array(rng.standard_normal((b, 1, 32)).astype(np.float32)),
                                    mx.array(rng.standard_normal((b, 1, 32)).astype(np.float32)))
        parts = [state.latent, state.rope] + ([state.index_keys] if state.index_keys is not None else [])
        mx.eval(parts)
        out.extend(np.array(p) for p in parts)
    return out


def same_reads(a: list, b: list) -> bool:
    ra, rb = reads(a), reads(b)
    return len(ra) == len(rb) and all(x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))
                                      for x, y in zip(ra, rb))


def populate(root: Path, *, kinds=tuple(SCHEMES), other_identity: bool = True) -> dict[str, tuple[int, int, str]]:
    """Save one session per kind (sessions ``s-<kind>``); ``s-mla`` twice more (a grown copy sharing its prefix and
    one in namespace ``tenant``); optionally one session under another identity. Returns session -> (n, seed, kind)."""
    plan = {}
    with open_store(root, identity=MODEL, chunk_tokens=CHUNK) as store:
        for i, kind in enumerate(kinds):
            n, seed = 70 + 10 * i, i + 1
            trim = 20 if kind.startswith("paged") else 0
            store.save(f"s-{kind}", tokens_for(n, seed), make_caches(kind, n, seed, trim=trim))
            plan[f"s-{kind}"] = (n, seed, kind)
        if "mla" in kinds:
            store.save("s-mla-copy", tokens_for(70, 1), make_caches("mla", 70, 1))
            plan["s-mla-copy"] = (70, 1, "mla")
            store.save("s-tenant", tokens_for(70, 1), make_caches("mla", 70, 1), namespace="tenant")
    if other_identity:
        with open_store(root, identity=OTHER, chunk_tokens=CHUNK) as store:
            store.save("s-other", tokens_for(50, 7), make_caches("mla", 50, 7))
    return plan


def template_store(tmp_path_factory, name: str, **populate_options) -> Path:
    """A module's populated store (built once per module; tests that change it work on a ``private_copy``)."""
    root = tmp_path_factory.mktemp(name) / "store"
    populate(root, **populate_options)
    return root


def private_copy(template: Path, tmp_path: Path) -> Path:
    """A test's own copy of a template store, for tests that change it."""
    root = tmp_path / "store"
    shutil.copytree(template, root)
    return root


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m kvshelf.tools.cli ARGS`` in a fresh process (what the ``kvshelf`` console script runs)."""
    full_env = {**os.environ, "KVSHELF_NO_PROGRESS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def run_json(*args: str, expect_rc: int = 0, **kw) -> dict:
    proc = run_cli(*args, "--json", **kw)
    assert proc.returncode == expect_rc, (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)
