"""Measure 33 (on request): generations that survive a crash — a retried long generation resumes from its checkpoint.

In-process, on a tiny seeded llama directory (``tests/helpers/tiny_model_dir.py``, the serving tests' fixture;
``llama-bench`` outside the small size), greedy decoding with EOS biased away so every run is exactly ``TOTAL``
tokens, through ``kvshelf.mlx_lm.resumable_generate`` on a fresh store per repetition:

* **retry, resumed**: a first run checkpoints every 256 tokens and is abandoned at ``KILLED_AT`` tokens (what a
  kill leaves: the checkpoints that were durable by then, the last at 1,280); the timed retry of the identical
  request finds the checkpoint, restores it and decodes the rest — time to its last token;
* **retry, from scratch**: the same retry on a store without checkpoints (prefill + every token again);
* **decode with checkpoints**: tokens/s of a whole run checkpointing every 256 tokens, against the same loop with
  checkpoints off (``checkpoint_every=0``).

Targets: resumed retry ≤ 0.3× from scratch; decode with checkpoints ≥ 0.95× without. Repetitions are
interleaved (scratch, resumed, with, without in turn) and the first is a warm-up. The retried outputs are compared
with the uninterrupted run's; a mismatch is a failed row (and a failed run) rather than wrong figures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .context import Context
from .harness import Row, Sample, failed, failure_row

_HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"
TOTAL, KILLED_AT, EVERY = 2000, 1500, 256
PROMPT_WORDS = {"small": 200}  # other sizes: 1000


def _generate(model, tokenizer, prompt, store, key, every, stop_at=None):
    from mlx_lm.sample_utils import make_logits_processors

    from kvshelf.mlx_lm import resumable_generate

    eos = list(tokenizer.eos_token_ids)
    out = []
    for r in resumable_generate(model, tokenizer, prompt, store=store, key=key, checkpoint_every=every,
                                max_tokens=TOTAL, logits_processors=make_logits_processors({e: -100.0 for e in eos})):
        out.append(r.token)
        if stop_at is not None and len(out) == stop_at:
            break
    return out


def run(ctx: Context, only: set[str]) -> list[Row]:
    name = "resume: time to last token of a retried 2,000-token generation killed at 1,500"
    try:
        from mlx_lm import load

        from kvshelf import open_store
        from kvshelf.mlx_lm import model_identity
    except Exception as exc:  # noqa: BLE001 - no mlx-lm: the row says so (a real error fails)
        return [failure_row("33", name, exc, target="≤ 0.3× scratch")]
    if str(_HELPERS) not in sys.path:
        sys.path.insert(0, str(_HELPERS))
    import tiny_model_dir as tiny

    small = ctx.workload.name == "small"
    root = ctx.scratch.fresh("resume")
    root.mkdir()
    model_dir = tiny.make_model_dir(root / "model", "llama" if small else "llama-bench", seed=11)
    model, tokenizer = load(str(model_dir))
    identity = model_identity(model_dir)
    prompt = tiny.words(PROMPT_WORDS.get(ctx.workload.name, 1000))
    times = {"scratch": [], "resumed": [], "with": [], "without": []}
    resumed_from, mismatches = [], 0
    reference = None
    for rep in range(ctx.reps + 1):
        got = {}
        with open_store(root / f"scratch-{rep}", identity) as store:
            t0 = time.perf_counter()
            ref = _generate(model, tokenizer, prompt, store, "retry", 0)
            got["scratch"] = (time.perf_counter() - t0) * 1e3
        reference = reference or ref
        with open_store(root / f"resumed-{rep}", identity) as store:
            _generate(model, tokenizer, prompt, store, "retry", EVERY, stop_at=KILLED_AT)  # the killed run
            found = store.find_generation_checkpoint("retry", tokenizer.encode(prompt))
            resumed_from.append(len(found.generated) if found is not None else 0)
            del found
            t0 = time.perf_counter()
            again = _generate(model, tokenizer, prompt, store, "retry", EVERY)
            got["resumed"] = (time.perf_counter() - t0) * 1e3
        mismatches += again != reference
        for label, every in (("with", EVERY), ("without", 0)):
            with open_store(root / f"{label}-{rep}", identity) as store:
                t0 = time.perf_counter()
                out = _generate(model, tokenizer, prompt, store, "speed", every)
                got[label] = len(out) / (time.perf_counter() - t0)
        if rep:
            for k, v in got.items():
                times[k].append(v)
    ctx.facts["resume"] = {"model": "llama" if small else "llama-bench", "prompt_tokens": len(tokenizer.encode(prompt)),
                           "resumed_from": resumed_from, "total": TOTAL, "killed_at": KILLED_AT, "every": EVERY}
    if mismatches:
        return [failed("33", name, f"{mismatches} resumed retries differ from the uninterrupted run",
                       target="≤ 0.3× scratch")]
    s = {k: Sample("ms" if k in ("scratch", "resumed") else "tok/s", v) for k, v in times.items()}
    return [
        Row("33", name, s["resumed"], s["scratch"], "retry from scratch", "≤ 0.3× scratch", 0.3,
            extra={"resumed_from": resumed_from}),
        Row("33", "… decode speed with checkpoints every 256 vs none", s["with"], s["without"],
            "checkpoints off", "≥ 0.95×", 0.95, check="ratio-min"),
    ]
