"""Measure 40 (on request): resident memory of a server fed distinct prompts, ``kvshelf serve --prompt-cache-bytes``
vs plain ``mlx_lm.server``.

Why: the most-asked complaint about MLX servers is resident memory growing past any cap. mlx-lm 0.32 bounds its
prompt cache by entries only (its ``--prompt-cache-bytes`` trims while a batch runs); ``kvshelf serve`` bounds the
RAM tier by bytes on every insert (``kvshelf/mlx_lm/serve/ram_tier.py``) and the store keeps what RAM drops.

Real server processes on 127.0.0.1 (the serving tests' harness), the tiny seeded llama of the serving tests
(``llama-kv``: 16 KiB of cache per token, so the caches, not the interpreter, dominate the figure). Both servers
get ``--prompt-cache-size 100000`` (the entry bound out of the way, as an operator serving long conversations sets
it); kvshelf also gets ``--prompt-cache-bytes 64M``. Each is sent ``PROMPTS`` distinct prompts of ``WORDS`` words
(``max_tokens=1``), one at a time; the server process's RSS (psutil) is read after every request: the curves.
The figure is the growth of RSS over the second half of the prompts (after kvshelf's bound is reached), kvshelf
against plain; target: flat (≤ 0.1× plain's growth). Repetitions alternate the two servers.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .context import Context
from .harness import Row, Sample, failure_row

_TESTS = Path(__file__).resolve().parents[1] / "tests"
PROMPTS = 200
WORDS = 500
BOUND = "64M"
MIB = 1 << 20


def _harness():
    for p in (_TESTS, _TESTS / "helpers"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    import serve_harness
    import tiny_model_dir

    return serve_harness, tiny_model_dir


def _curve(h, tiny, model: Path, store: Path | None, log: Path, extra: tuple[str, ...]) -> list[float]:
    import psutil

    words, vocab = tiny.words, tiny.WORDS
    rss = []
    with h.Server(model, store, log, extra=extra) as server:
        proc = psutil.Process(server.proc.pid)
        for i in range(PROMPTS):
            text = f"{vocab[i % len(vocab)]} {vocab[i // len(vocab)]} " + words(WORDS, salt=i)
            server.chat([{"role": "user", "content": text}], max_tokens=1)
            rss.append(proc.memory_info().rss / MIB)
    return rss


def run(ctx: Context, only: set[str]) -> list[Row]:
    name = f"serve: RSS growth over prompts {PROMPTS // 2}-{PROMPTS}, --prompt-cache-bytes {BOUND} vs plain mlx_lm.server"
    try:
        import mlx_lm  # noqa: F401
        import psutil  # noqa: F401

        from kvshelf.mlx_lm.serve.server import main as _main  # noqa: F401

        h, tiny = _harness()
        root = ctx.scratch.fresh("serve-memory")
        root.mkdir()
        model = tiny.make_model_dir(root / "model", "llama-kv", seed=11)
        ours, plain, curves = [], [], {"kvshelf": [], "plain": []}
        common = ("--prompt-cache-size", "100000")
        for rep in range(ctx.reps):
            for who in (("kvshelf", "plain") if rep % 2 == 0 else ("plain", "kvshelf")):
                store = root / f"store-{rep}" if who == "kvshelf" else None
                extra = common + (("--prompt-cache-bytes", BOUND) if who == "kvshelf" else ())
                curve = _curve(h, tiny, model, store, root / f"{who}-{rep}.log", extra)
                curves[who].append([round(x, 1) for x in curve])
                growth = curve[-1] - curve[PROMPTS // 2 - 1]
                (ours if who == "kvshelf" else plain).append(growth)
    except Exception as exc:  # noqa: BLE001 - a failed row (the run exits non-zero), or not available
        return [failure_row("40", name, exc)]
    return [Row("40", name, Sample("MiB", ours), Sample("MiB", plain), "plain mlx_lm.server (RSS growth)",
                "≤ 0.1× plain (flat after the bound)", 0.1, extra={"rss_mib_after_each_prompt": curves})]


__all__ = ["run"]
