"""Measure 38: start-up identity time on a 4 GiB weights directory, the fingerprint sidecar warm vs cold.

Why: the served model's id is a content hash of its weights (``kvshelf/mlx_lm/serve/weights_fingerprint.py``);
hashing reads every byte, so a restart must find the digests in the store's sidecar instead. The weights are real
random bytes (a sparse file would read as zeros without touching a disk: not an honest read), written to the run's
scratch directory and removed after. "Cold" is a store without the sidecar (every byte hashed; the files are likely
in the page cache, since they were just written, so this is the hashing cost, not a cold-disk read); "warm" is a
restart on the store that remembered them. The sides are interleaved; ``--size small`` uses 64 MiB.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path

from .context import Context
from .harness import Row, Sample, failed, failure_row

_TESTS = Path(__file__).resolve().parent.parent / "tests" / "helpers"
GiB, MiB = 1 << 30, 1 << 20
_FILE_BYTES = 512 * MiB


def _weights_dir(root: Path, total: int) -> Path:
    """A model directory (the tiny llama's config and tokenizer) with ``total`` bytes of random weights."""
    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))
    import tiny_model_dir

    model = tiny_model_dir.make_model_dir(root / "weights-4g", "llama", seed=5)
    os.remove(model / "model.safetensors")
    per_file = min(_FILE_BYTES, total)
    for i in range(max(1, total // per_file)):
        header = json.dumps({f"w{i}": {"dtype": "U8", "shape": [per_file], "data_offsets": [0, per_file]}}).encode()
        with open(model / f"model-{i:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            left = per_file
            while left:
                n = min(left, 64 * MiB)
                f.write(os.urandom(n))
                left -= n
    return model


def run(ctx: Context, only: set[str]) -> list[Row]:
    name = "serve start-up: model identity of 4 GiB of weights, sidecar warm vs cold"
    try:
        from kvshelf.mlx_lm.serve.model_identity import model_identity
        from kvshelf.mlx_lm.serve.weights_fingerprint import FingerprintSidecar
    except Exception as exc:  # noqa: BLE001 - no mlx-lm: the row says so
        return [failure_row("38", name, exc)]
    root = ctx.scratch.fresh("identity")
    root.mkdir()
    total = 64 * MiB if ctx.workload.name == "small" else 4 * GiB
    try:
        model = _weights_dir(root, total)
        warm_store = root / "warm-store"
        model_identity(model, fingerprints=warm_store)  # fills the warm side's sidecar
        cold, warm, hashed = [], [], []
        for rep in range(ctx.reps + 1):
            sidecar = FingerprintSidecar.in_store(root / f"cold-store-{rep}")
            t0 = time.perf_counter()
            a = model_identity(model, fingerprints=sidecar)
            t_cold = time.perf_counter() - t0
            again = FingerprintSidecar.in_store(warm_store)
            t0 = time.perf_counter()
            b = model_identity(model, fingerprints=again)
            t_warm = time.perf_counter() - t0
            if a != b or again.hashed:
                return [failed("38", name, f"warm start hashed {again.hashed} files or named another identity",
                               target="≤ 0.05 s warm")]
            if rep:
                cold.append(t_cold)
                warm.append(t_warm)
                hashed.append(sidecar.hashed)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return [Row("38", name, Sample("s", warm), Sample("s", cold), f"no sidecar (hashes {total // MiB} MiB)",
                "≤ 0.05 s warm", 0.05, check="value", extra={"weights_bytes": total, "cold_files_hashed": hashed})]
