"""A subprocess that runs ``kvshelf.mlx_lm.resumable_generate`` on a tiny model directory, for the crash tests.

``python generation_worker.py MODEL_DIR STORE_DIR [--die-at-sync N]``: a sampled (temperature 0.8, seeded) long
generation with checkpoints every ``EVERY`` tokens, logging kvshelf's lines on stderr and printing the generated
token ids and text as one JSON line on stdout when it completes. ``--die-at-sync N`` SIGKILLs the process itself at
the N-th durable step the store takes (a file fsync, a directory fsync, an index commit, as ``kvshelf.store.base.syncs``
sees them): a crash at a chosen point inside a checkpoint's write.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

EVERY = 32
MAX_TOKENS = 200
SEED = 1234
TEMPERATURE = 0.8


def die_at_sync(n: int) -> None:
    """SIGKILL this process at the ``n``-th fsync / directory fsync / index commit from now on."""
    from kvshelf.store.base import syncs

    seen = [0]
    original = syncs._count

    def count(kind: str) -> None:
        original(kind)
        seen[0] += 1
        if seen[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    syncs._count = count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("store")
    p.add_argument("--die-at-sync", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.sample_utils import make_logits_processors, make_sampler
    from tiny_model_dir import EOS, VOCAB, words

    from kvshelf import open_store
    from kvshelf.mlx_lm import model_identity, resumable_generate

    model, tokenizer = load(a.model)
    with open_store(a.store, identity=model_identity(a.model)) as store:
        if a.die_at_sync:
            die_at_sync(a.die_at_sync)
        mx.random.seed(SEED)
        tokens, text = [], ""
        for r in resumable_generate(model, tokenizer, words(60), store=store, key=f"story-t{TEMPERATURE}-s{SEED}",
                                    checkpoint_every=EVERY, max_tokens=MAX_TOKENS,
                                    sampler=make_sampler(TEMPERATURE),
                                    logits_processors=make_logits_processors({VOCAB.index(EOS): -100.0})):
            tokens.append(r.token)
            text += r.text
    print(json.dumps({"tokens": tokens, "text": text}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
