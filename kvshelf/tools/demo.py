"""``kvshelf demo``: the store's main job, end to end, on the synthetic MLA model.

Four chat sessions share a system prompt. They are prefilled and saved (the shared prompt's chunks are written
once); one is restored in place of recomputing its prefill and continued, giving logits bit-identical to a process
that never stopped; a new chat reuses the stored system prompt through ``restore_prefix`` and prefills only its own
turn; two sessions are restored straight into one batch. A short table reports tokens reused, bytes written versus
reused, and times.

Every session the demo writes lives in its own namespace (``kvshelf-demo``), so a real store is never touched
outside it; a rerun replaces the demo's sessions and tells the same story.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from .paths import default_store_path

NAMESPACE = "kvshelf-demo"
SYSTEM_TOKENS = 512  # two whole 256-token chunks, written once and shared by every chat
USER_TOKENS = (100, 130, 160, 190)  # each chat's own turn
DECODE_TOKENS = 4  # greedy tokens generated (and fed back) after each prompt
# small enough that the whole demo runs in a few seconds on a 2-core CPU; DSA index keys on, as in GLM
MODEL = dict(num_layers=4, vocab=512, hidden=128, num_heads=2, kv_lora_rank=64, rope_head_dim=16, index_head_dim=16,
             qk_nope_head_dim=32, v_head_dim=32, seed=7)


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    if isinstance(value, mx.array):
        mx.eval(value)
    return value, time.perf_counter() - start


def _eval_caches(caches: Sequence) -> None:
    mx.eval([c.state for c in caches])


def _prefill(model, tokens: Sequence[int], caches: Sequence) -> mx.array:
    """Run ``tokens`` through the model into ``caches``; the last position's logits, evaluated."""
    logits = model(mx.array([list(tokens)], dtype=mx.int32), caches)[:, -1, :]
    mx.eval(logits)
    _eval_caches(caches)
    return logits


def _chat(model, tokens: list[int], caches: Sequence, new_tokens: int) -> list[int]:
    """Greedy-decode ``new_tokens`` after ``tokens``; returns every token now held by the caches."""
    fed = list(tokens)
    logits = _prefill(model, fed, caches)
    for _ in range(new_tokens):
        nxt = int(mx.argmax(logits, axis=-1).item())
        fed.append(nxt)
        logits = _prefill(model, [nxt], caches)
    return fed


def _same_bits(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array(a).tobytes() == np.array(b).tobytes()


def _same_caches(got: Sequence, want: Sequence) -> bool:
    """Whether two lists of serial caches hold bit-identical state (compared through their codecs)."""
    from kvshelf.codecs import default_provider

    for a, b in zip(got, want, strict=True):
        (ea, xa), (eb, xb) = (default_provider.for_cache(c).snapshot(c) for c in (a, b))
        if ea.offset != eb.offset or len(xa) != len(xb) or not all(map(_same_bits, xa, xb)):
            return False
    return True


def _require(ok: bool, what: str) -> None:
    """A fact the demo shows did not hold: a bug in the store or the caches, never a usage error."""
    if not ok:
        from kvshelf.errors import KvShelfError

        raise KvShelfError(f"kvshelf demo: {what}")


def _bytes_read(store) -> int:
    """Chunk bytes this store handle has read so far (its ``stats()`` counter)."""
    return int(store.stats()["bytes_read"])


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def _ms(s: float) -> str:
    return f"{s * 1000:,.1f} ms" if s < 0.01 else f"{s * 1000:,.0f} ms"


def _render(rows: list[tuple[str, ...]]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvshelf demo", title_justify="left")
    for column in ("step", "tokens reused", "bytes written", "bytes reused", "time"):
        table.add_column(column, justify="left" if column in ("step", "time") else "right")
    for row in rows:
        table.add_row(*row)
    width = max(80, min(120, shutil.get_terminal_size((120, 24)).columns))
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False)
    console.print(table)
    return console.file.getvalue().rstrip("\n")


class _Demo:
    """The demo's state between steps: the model, the open store, the live (never stopped) caches, the table."""

    def __init__(self, store, out: Callable[[str], object]):
        from ..latent_legos import SyntheticMLAModel  # the public path (forwarded lazily from kvshelf.testing)

        self.store, self.out = store, out
        self.model = SyntheticMLAModel(**MODEL)
        self.system = _tokens(1, SYSTEM_TOKENS, MODEL["vocab"])
        self.live: dict[str, tuple[list[int], list]] = {}
        self.rows: list[tuple[str, ...]] = []
        self.facts: dict = {}

    def save_chats(self) -> None:
        """Four chats sharing the system prompt: prefill, decode a few tokens, save (the prompt's chunks once)."""
        written = reused = 0
        for i, n in enumerate(USER_TOKENS):
            name, caches = f"chat-{i}", self.model.make_caches()
            prompt = self.system + _tokens(100 + i, n, MODEL["vocab"])
            fed, prefill_s = _timed(lambda: _chat(self.model, prompt, caches, DECODE_TOKENS))
            info, save_s = _timed(lambda: self.store.save(name, fed, caches, namespace=NAMESPACE))
            self.live[name] = (fed, caches)
            written, reused = written + info.bytes_written, reused + info.bytes_reused
            self.rows.append((f"save {name} ({len(fed)} tok)", "-", _kib(info.bytes_written),
                              _kib(info.bytes_reused) + " dedup", f"prefill {_ms(prefill_s)}, save {_ms(save_s)}"))
        self.facts.update(bytes_written=written, bytes_reused=reused)

    def restore_and_continue(self) -> None:
        """A restart: restore chat-1 instead of recomputing it, continue, and compare with never having stopped."""
        fed, live_caches = self.live["chat-1"]
        read0 = _bytes_read(self.store)
        restored, restore_s = _timed(lambda: self.store.restore("chat-1", namespace=NAMESPACE))
        _eval_caches(restored.caches)
        read = _bytes_read(self.store) - read0
        _require(list(restored.tokens) == fed, "restored chat-1 holds other tokens than were saved")
        _, recompute_s = _timed(lambda: _prefill(self.model, fed, self.model.make_caches()))
        turn = _tokens(200, 24, MODEL["vocab"])
        equal = _same_bits(_prefill(self.model, turn, restored.caches), _prefill(self.model, turn, live_caches))
        _require(equal, "logits continuing from the restored caches differ from never stopping")
        self.facts.update(logits_equal=equal, restored_tokens=restored.length, restore_bytes_read=read,
                          restore_seconds=restore_s, recompute_seconds=recompute_s)
        self.rows.append((f"restore chat-1 ({restored.length} tok)", str(restored.length), "-", _kib(read) + " read",
                          f"{_ms(restore_s)} vs prefill {_ms(recompute_s)} ({recompute_s / restore_s:,.0f}x)"))
        self.out(f"continuing chat-1 from restored caches: logits bit-identical to never stopping: {equal}")

    def reuse_prefix(self) -> None:
        """A new chat finds the stored system prompt, restores just that prefix and prefills only its own turn."""
        prompt = self.system + _tokens(300, 150, MODEL["vocab"])
        hit, lookup_s = _timed(lambda: self.store.lookup(prompt, namespace=NAMESPACE))
        read0 = _bytes_read(self.store)
        prefix, prefix_s = _timed(lambda: self.store.restore_prefix(prompt, namespace=NAMESPACE))
        _require(hit is not None and prefix is not None, "the stored system prompt was not found for a new chat")
        _eval_caches(prefix.caches)
        read = _bytes_read(self.store) - read0
        rest, rest_s = _timed(lambda: _prefill(self.model, prompt[prefix.length:], prefix.caches))
        full, full_s = _timed(lambda: _prefill(self.model, prompt, self.model.make_caches()))
        drift = float(mx.max(mx.abs(rest - full)).item())
        self.facts.update(prefix_tokens=prefix.length, prefix_from=hit.session_id, prefix_bytes_read=read,
                          lookup_seconds=lookup_s, prefix_logits_max_abs_diff=drift)
        self.rows.append((f"new chat, prefix ({len(prompt)} tok)", str(prefix.length), "-", _kib(read) + " read",
                          f"{_ms(lookup_s + prefix_s + rest_s)} vs prefill {_ms(full_s)} (lookup {_ms(lookup_s)})"))
        agreement = "bit-identical" if drift == 0.0 else f"within {drift:.2e} (another prefill split rounds otherwise)"
        self.out(f"new chat: reused {prefix.length} of {len(prompt)} prompt tokens from {hit.session_id}, prefilled "
                 f"the other {len(prompt) - prefix.length}; logits vs a full prefill: {agreement}")

    def restore_batch(self) -> None:
        """Two sessions restored straight into one batch: each row is bit-identical to its live caches."""
        names = ["chat-2", "chat-3"]
        read0 = _bytes_read(self.store)
        batch, batch_s = _timed(lambda: self.store.restore_batch([(n, NAMESPACE) for n in names]))
        _eval_caches(batch.caches)
        read = _bytes_read(self.store) - read0
        exact = all(_same_caches([c.extract_row(row) for c in batch.caches], self.live[name][1])
                    for row, name in enumerate(names))
        _require(exact, "a batch row differs from the caches it was saved from")
        step = mx.array([[self.live[n][0][-1]] for n in names], dtype=mx.int32)
        mx.eval(self.model(step, batch.caches))  # and the batch decodes
        self.facts.update(batch_lengths=list(batch.lengths), batch_rows_exact=exact)
        self.rows.append((f"restore_batch {' + '.join(names)}", str(sum(batch.lengths)), "-", _kib(read) + " read",
                          f"{_ms(batch_s)}, {len(names)} rows bit-exact"))


def run_demo(store_dir: str | Path | None = None, out: Callable[[str], object] = print) -> dict:
    """Run the demo on ``store_dir`` (default: the embedded default store); returns the facts it showed."""
    from kvshelf import Identity, open_store

    started = time.perf_counter()
    path = Path(store_dir) if store_dir is not None else default_store_path()
    identity = Identity("kvshelf-demo/synthetic-mla", config_fingerprint=repr(sorted(MODEL.items())),
                        tokenizer_hash="synthetic")
    out(f"kvshelf demo: store {path} (namespace {NAMESPACE!r}), synthetic MLA model "
        f"{MODEL['num_layers']} layers, kv_lora_rank {MODEL['kv_lora_rank']}")
    with open_store(str(path), identity=identity) as store:
        for info in store.sessions(namespace=NAMESPACE):  # a rerun starts from the same empty namespace
            store.delete(info.session_id, namespace=NAMESPACE)
        demo = _Demo(store, out)
        demo.save_chats()
        demo.restore_and_continue()
        demo.reuse_prefix()
        demo.restore_batch()
    facts = {"store": str(path), "namespace": NAMESPACE, **demo.facts}
    facts["tokens_reused"] = facts["restored_tokens"] + facts["prefix_tokens"] + sum(facts["batch_lengths"])
    facts["seconds"] = time.perf_counter() - started
    demo.rows.append(("total", f"{facts['tokens_reused']:,}", _kib(facts["bytes_written"]),
                      _kib(facts["bytes_reused"]) + " dedup", f"{facts['seconds']:.2f} s"))
    out(_render(demo.rows))
    return facts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvshelf demo", description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store directory (default: the embedded default store)")
    args = parser.parse_args(argv)
    run_demo(args.store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
