"""``kvshelf serve`` that SIGKILLs itself at the write of a chosen generation checkpoint, for the crash tests.

``python dying_serve.py serve ARGS...`` runs ``kvshelf serve ARGS...`` unchanged, except that with
``KVSHELF_TEST_DIE_AT_GENERATED=N`` in its environment the first generation checkpoint write of a request with ``N``
generated tokens kills the process (SIGKILL: no flush, no cleanup) before anything of it reaches the store, after
printing ``test launcher: SIGKILL at generation checkpoint generated=N key=<sha256>``. The checkpoint writes go
through the store's public ``save_generation_checkpoint`` (``GenerationCheckpointWriter``), so that is where the
kill is placed: the write of that row's checkpoint, whatever else the batch is doing.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DIE_ENV = "KVSHELF_TEST_DIE_AT_GENERATED"


def die_at_generated(n: int) -> None:
    from kvshelf.store import Store

    original = Store.save_generation_checkpoint

    def save_generation_checkpoint(self, key, tokens, caches, *, prompt_length, **options):
        if len(tokens) - prompt_length == n:
            print(f"test launcher: SIGKILL at generation checkpoint generated={n} key={key}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, key, tokens, caches, prompt_length=prompt_length, **options)

    Store.save_generation_checkpoint = save_generation_checkpoint


if __name__ == "__main__":
    if os.environ.get(DIE_ENV):
        die_at_generated(int(os.environ[DIE_ENV]))
    from kvshelf.tools.cli import main

    sys.exit(main(sys.argv[1:]))
