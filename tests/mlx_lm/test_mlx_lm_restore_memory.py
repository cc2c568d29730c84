"""A restored mlx-lm ``KVCache`` session costs its KV bytes once, not twice (issue 32: "the restore streams layer by
layer into the caches with no full extra copy").

Why a test: the restore read ``[1, H, T, w]`` planes and then grew each to mlx-lm's buffer capacity (a multiple of
256 rows) by concatenating zero columns — a second full copy of every restored byte, so MLX's peak memory during a
restore was twice the KV (2 GiB extra for a 64K-token session of 32 KiB per token). Now the store reads the chunks
straight into ``[1, H, capacity, w]`` buffers (``PlainCodec.row_plan``) that the restored ``KVCache`` adopts.

The restore runs in a fresh process so that its memory is its own: MLX's own count of the bytes it held at once
(``mx.get_peak_memory``) and the kernel's high-water mark of the process (``VmHWM``) over its resident set just
before the restore, both against the KV bytes. The session is 8 layers × 8 KV heads × 128 dims in bfloat16 (the
long-context benchmark's geometry) at 4,196 tokens, so the buffers have spare capacity (4,352 rows): 136 MiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from store_cases import open_test_store

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
LAYERS, HEADS, DIM, TOKENS = 8, 8, 128, 4196

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[2])
import mlx.core as mx
from store_cases import open_test_store

def status():
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
            if l.startswith(("VmHWM", "VmRSS"))}

with open_test_store(sys.argv[1], chunk_tokens=1024) as store:
    small = store.restore("small")  # the restore path's imports, threads and buffers, before the baseline
    mx.eval([c.state for c in small.caches])
    del small
    before = status()
    mx.reset_peak_memory()
    restored = store.restore("long")
    mx.eval([c.state for c in restored.caches])
    after = status()
    print(json.dumps({"peak": mx.get_peak_memory(), "rss_before": before["VmRSS"], "hwm_after": after["VmHWM"],
                      "kv": sum(c.nbytes for c in restored.caches), "offsets": [c.offset for c in restored.caches],
                      "rows": [c.keys.shape[2] for c in restored.caches]}))
"""


def _session(n: int, seed: int) -> list[KVCache]:
    caches = [KVCache() for _ in range(LAYERS)]
    for i, c in enumerate(caches):
        k1, k2 = mx.random.split(mx.random.key(seed + i))
        c.update_and_fetch(mx.random.normal((1, HEADS, n, DIM), key=k1).astype(mx.bfloat16),
                           mx.random.normal((1, HEADS, n, DIM), key=k2).astype(mx.bfloat16))
    mx.eval([c.state for c in caches])
    return caches


def test_a_restored_kv_session_is_read_into_its_buffers_once(tmp_path):
    caches = _session(TOKENS, 1)
    kv = sum(c.nbytes for c in caches)
    with open_test_store(tmp_path / "s", chunk_tokens=1024) as store:
        store.save("long", list(range(TOKENS)), caches)
        store.save("small", [7] * 64, _session(64, 50))
    del caches
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "s"), str(HELPERS)], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kv"] == kv == LAYERS * 2 * HEADS * 4352 * DIM * 2  # mlx-lm's buffer, capacity rows included
    assert got["offsets"] == [TOKENS] * LAYERS and got["rows"] == [4352] * LAYERS
    assert got["peak"] <= 1.05 * kv, f"MLX held {got['peak'] / kv:.2f}× the KV bytes during the restore"
    grown = got["hwm_after"] - got["rss_before"]
    assert grown <= 1.08 * kv, f"the process grew by {grown / kv:.2f}× the KV bytes during the restore"
