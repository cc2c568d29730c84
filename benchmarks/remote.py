"""Measures 21-23: the shared tier (``kvshelf.store.remote``) on a real redis-server started for the run.

21. Remote restore of a session (64 MiB and 512 MiB; 8 and 32 MiB at ``--size small``) into an empty local store
    (fetch, verify every chunk's hash, build the caches, eval) as bytes per second, against ``redis-benchmark -t
    get -d <chunk value size> -c 1`` on the same server: what one client can GET at that value size (one request
    in flight; the restore pipelines a batch). Target ≥ 70%. ``-c 8`` is recorded in the JSON extras.
22. Remote ``lookup`` of a 32,768-token prompt (4,096 at ``small``) against a shared index of 200 snapshots sharing
    prefixes, against the local lookup on an index holding the same snapshots, interleaved: target ≤ 2× local
    (loopback).
23. TTFT on the synthetic MLA model (1,024 tokens; 256 at ``small``): recompute the prompt vs restore it locally vs
    restore it from the remote tier, each followed by the first decode step (so the restored caches are used).

Only opt-in (``--only 21,22,23``): the default run needs no redis-server. No redis-server → "not available".
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import mlx.core as mx
import numpy as np

from . import data
from .context import Context
from .harness import MiB, MissingDependency, Row, Sample, failure_row, time_interleaved, time_reps

SESSIONS = {"small": (8, 32), "L": (64, 512)}
# measure 22's target, a ratio to the local lookup over the same snapshots timed in the same rounds (it was "≤ 2 ms";
# an absolute time says more about the machine than about the round trips)
REMOTE_LOOKUP = ("≤ 2× local lookup", 2.0)


class _Server:
    """A throwaway redis-server on a free 127.0.0.1 port, persistence off."""

    def __init__(self, scratch):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = scratch.fresh("redis")
        self.dir.mkdir()
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "PING"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def flush(self) -> None:
        subprocess.run(["redis-cli", "-p", str(self.port), "FLUSHALL"], capture_output=True)

    def get_throughput(self, value_bytes: int, requests: int, clients: int = 1) -> Sample:
        """redis-benchmark GET bytes/s at this value size, ``clients`` connections (its SET phase fills the key)."""
        cmd = ["redis-benchmark", "-p", str(self.port), "-t", "set,get", "-d", str(value_bytes), "-n",
               str(requests), "-c", str(clients), "--csv"]
        reps = []
        for _ in range(3):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
            for line in out.splitlines():
                cells = [c.strip('"') for c in line.split(",")]
                if cells and cells[0] == "GET":
                    reps.append(float(cells[1]) * value_bytes / MiB)
        self.flush()
        return Sample("MiB/s", reps)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _session(mib: int, seed: int):
    """MLA caches (16 layers, latent 512 + rope 64, f32) holding about ``mib`` MiB, and their tokens."""
    from kvshelf.latent_legos import LatentGeometry, MLACache

    layers, width = 16, 512 + 64
    tokens = max(256, mib * MiB // (layers * width * 4))
    rng = np.random.default_rng(seed)
    caches = []
    for _ in range(layers):
        c = MLACache(LatentGeometry(512, 64))
        c.append_latent(mx.array(rng.standard_normal((1, tokens, 512), dtype=np.float32)),
                        mx.array(rng.standard_normal((1, tokens, 64), dtype=np.float32)), None)
        caches.append(c)
    mx.eval([c.state for c in caches])
    return data.token_ids(tokens, seed), caches


def _restore_rows(ctx: Context, server: _Server, size: str) -> list[Row]:
    rows = []
    for mib in SESSIONS[size]:
        toks, caches = _session(mib, seed=mib)
        a = ctx.open_store(ctx.scratch.fresh("host-a"), remote=server.url)
        a.save("big", toks, caches)
        a.tier.flush(600)
        nbytes = a.tier.counters["bytes_uploaded"]
        value_bytes = nbytes // max(1, a.tier.counters["chunks_uploaded"])
        a.close()
        del caches
        b = ctx.open_store(ctx.scratch.fresh("host-b"), remote=server.url,
                           remote_options={"keep_local": False, "socket_timeout": 30})
        prompt = toks + [1]

        def restore(_):
            r = b.restore_prefix(prompt)
            mx.eval([c.state for c in r.caches])
            assert r.length == len(toks)
            return r

        t = time_reps(restore, ctx.large_reps if mib > 64 else ctx.reps, unit="s")
        b.close()
        value = Sample("MiB/s", [nbytes / MiB / s for s in t.reps])
        requests = max(10, min(200, (256 << 20) // value_bytes))  # ~256 MiB of GETs per repetition
        baseline = server.get_throughput(value_bytes, requests)
        many = server.get_throughput(value_bytes, requests, clients=8)  # for the record: several clients at once
        server.flush()
        rows.append(Row("21", f"remote restore {nbytes / MiB:.0f} MiB (hash-verified, eval)", value, baseline,
                        f"redis-benchmark GET -d {value_bytes} -c 1", target="≥ 70% of GET", limit=0.70,
                        check="ratio-min", extra={"chunk_value_bytes": value_bytes, "seconds": t.to_json(),
                                                  "redis_benchmark_get_c8_mib_s": many.to_json()}))
    return rows


def _lookup_rows(ctx: Context, server: _Server, size: str) -> list[Row]:
    from kvshelf.latent_legos import LatentGeometry, MLACache
    from kvshelf.store.identity import namespace_key
    from kvshelf.store.prefix.search import LazyTokens, PrefixSearch
    from kvshelf.store.remote.search import RedisRecords

    n = 4096 if size == "small" else 32768
    trunk = data.token_ids(n - 1024, seed=77, high=100_000)

    def tiny(length):
        c = MLACache(LatentGeometry(16, 8))
        c.append_latent(mx.zeros((1, length, 16)), mx.zeros((1, length, 8)), None)
        return [c]

    n_snapshots = 60 if size == "small" else 200
    store = ctx.open_store(ctx.scratch.fresh("lookup"), remote=server.url, chunk_tokens=4096)
    for i in range(n_snapshots):
        tail = data.token_ids(512 if i < 20 else 64, seed=1000 + i, high=100_000)
        toks = (trunk + tail) if i < 20 else (trunk[:512] + tail)
        store.save(f"s{i}", toks, tiny(len(toks)))
    store.tier.flush(600)
    prompt = np.asarray(trunk + data.token_ids(1024, seed=1003, high=100_000), dtype=np.int64)
    tier = store.tier

    local_hit = store.lookup(prompt)

    def remote(_):
        hit = tier.lookup(LazyTokens(prompt), "", None)
        assert hit is not None and hit.length == local_hit.length, (hit, local_hit)
        return hit

    as_list = prompt.tolist()
    s = time_interleaved({"remote": remote, "local": lambda _: store.lookup(prompt),
                          "remote list": lambda _: tier.lookup(LazyTokens(as_list), "", None),
                          "local list": lambda _: store.lookup(as_list)}, 50, collect=False)
    nsk = namespace_key(store.id_key, "")
    probe = RedisRecords(tier.client, tier.keys, nsk)  # counts the round trips of one lookup
    PrefixSearch(probe, nsk, LazyTokens(prompt)).run()
    store.close()
    server.flush()
    what = f"{len(prompt)}-token prompt, {n_snapshots} snapshots"
    return [Row("22", f"remote lookup, {what} (int array)", s["remote"], s["local"],
                "local lookup (LMDB), same snapshots", target=REMOTE_LOOKUP[0], limit=REMOTE_LOOKUP[1],
                extra={"round_trips": probe.round_trips}),
            Row("22", f"remote lookup, {what} (Python list)", s["remote list"], s["local list"],
                "local lookup (LMDB), same list", target=REMOTE_LOOKUP[0], limit=REMOTE_LOOKUP[1])]


def _ttft_rows(ctx: Context, server: _Server, size: str) -> list[Row]:
    from kvshelf.testing.synthetic_model import SyntheticMLAModel

    n = 256 if size == "small" else 1024  # the synthetic model's prefill is quadratic and slow on CPU
    model = SyntheticMLAModel(num_layers=4, hidden=256, num_heads=4, kv_lora_rank=512, rope_head_dim=64)
    tokens = mx.random.randint(0, 256, (1, n + 1), key=mx.random.key(3)).astype(mx.int32)
    prompt = tokens[0].tolist()

    def first_step(caches):
        out = model(tokens[:, n:n + 1], caches)
        mx.eval(out)
        return out

    def recompute(_):
        caches = model.make_caches()
        mx.eval(model(tokens[:, :n], caches))
        return first_step(caches)

    caches = model.make_caches()
    mx.eval(model(tokens[:, :n], caches))
    a = ctx.open_store(ctx.scratch.fresh("ttft-a"), remote=server.url)
    a.save("prompt", prompt[:n], caches)
    a.tier.flush(600)
    b = ctx.open_store(ctx.scratch.fresh("ttft-b"), remote=server.url, remote_options={"keep_local": False})

    def local(_):
        return first_step(a.restore_prefix(prompt).caches)

    def remote(_):
        r = b.restore_prefix(prompt)
        assert r is not None and r.length == n
        return first_step(r.caches)

    s = time_interleaved({"recompute": recompute, "local": local, "remote": remote}, ctx.reps)
    base, loc, rem = s["recompute"], s["local"], s["remote"]
    a.close()
    b.close()
    server.flush()
    what = f"{n} tokens, synthetic MLA 4 layers, latent 512"
    return [Row("23", f"TTFT local restore + 1 step ({what})", loc, base, "recompute prefill + 1 step",
                target="report", check="none"),
            Row("23", f"TTFT remote restore + 1 step ({what}; keep_local off)", rem, base, "recompute prefill + 1 step",
                target="report", check="none")]


def run(ctx: Context, wanted: set[str]) -> list[Row]:
    size = "small" if ctx.workload.name == "small" else "L"
    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        missing = MissingDependency("redis-server / redis-benchmark not on the PATH")
        return [failure_row(m, f"measure {m} (remote)", missing) for m in sorted(wanted, key=int)]
    server = _Server(ctx.scratch)
    try:
        rows: list[Row] = []
        if "22" in wanted:
            rows += _lookup_rows(ctx, server, size)
        if "23" in wanted:
            rows += _ttft_rows(ctx, server, size)
        if "21" in wanted:
            rows += _restore_rows(ctx, server, size)
        return rows
    finally:
        server.close()
