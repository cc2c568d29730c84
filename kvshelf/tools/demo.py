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

NAMESPACE = "kvshelf-demo"
SYSTEM_TOKENS = 512  # two whole 256-token chunks, written once and shared by every chat
USER_TOKENS = (100, 130, 160, 190)  # each chat's own turn
DECODE_TOKENS = 4  # greedy tokens generated (and fed back) after each prompt
# small enough that the whole demo runs in a few seconds on a 2-core CPU; DSA index keys on, as in GLM
MODEL = dict(num_layers=4, vocab=512, hidden=128, num_heads=2, kv_lora_rank=64, rope_head_dim=16, index_head_dim=16,
             qk_nope_head_dim=32, v_head_dim=32, seed=7)


def default_store_dir() -> Path:
    """The embedded default store: the store package's helper when it has one, else the tools' path rule."""
    try:
        from kvshelf.store import default_store_path  # type: ignore[attr-defined]
    except ImportError:
        from kvshelf.tools.paths import default_store_path
    return Path(default_store_path())


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


def _bytes_read(store) -> int:
    """Chunk bytes this store handle has read so far (its ``stats()`` counter)."""
    return int(store.stats()["bytes_read"])


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def _ms(s: float) -> str:
    return f"{s * 1000:,.1f} ms" if s < 0.01 else f"{s * 1000:,.0f} ms"


def _render(table) -> str:
    from rich.console import Console

    width = max(80, min(120, shutil.get_terminal_size((120, 24)).columns))
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False)
    console.print(table)
    return console.file.getvalue().rstrip("\n")


def run_demo(store_dir: str | None = None, out: Callable[[str], object] = print) -> dict:
    """Run the demo on ``store_dir`` (default: the embedded default store) and return what it showed."""
    from rich.table import Table

    from kvshelf import Identity, open_store
    from kvshelf.codecs import default_provider
    from kvshelf.latent_legos.synthetic_model import SyntheticMLAModel

    started = time.perf_counter()
    path = Path(store_dir) if store_dir is not None else default_store_dir()
    model = SyntheticMLAModel(**MODEL)
    identity = Identity("kvshelf-demo/synthetic-mla", config_fingerprint=repr(sorted(MODEL.items())),
                        tokenizer_hash="synthetic")
    vocab = MODEL["vocab"]
    system = _tokens(1, SYSTEM_TOKENS, vocab)
    users = [_tokens(100 + i, n, vocab) for i, n in enumerate(USER_TOKENS)]
    names = [f"chat-{i}" for i in range(4)]
    rows: list[tuple[str, str, str, str, str]] = []
    facts: dict = {"store": str(path), "namespace": NAMESPACE}
    out(f"kvshelf demo: store {path} (namespace {NAMESPACE!r}), synthetic MLA model "
        f"{MODEL['num_layers']} layers, kv_lora_rank {MODEL['kv_lora_rank']}")

    with open_store(str(path), identity=identity) as store:
        for name in names + ["chat-new"]:
            if any(s.session_id == name for s in store.sessions(namespace=NAMESPACE)):
                store.delete(name, namespace=NAMESPACE)

        # 1. four chats sharing the system prompt: prefill, a few decoded tokens, save
        live: dict[str, tuple[list[int], list]] = {}
        written = reused = 0
        for name, user in zip(names, users):
            caches = model.make_caches()
            fed, seconds = _timed(lambda: _chat(model, system + user, caches, new_tokens=DECODE_TOKENS))
            info, save_s = _timed(lambda: store.save(name, fed, caches, namespace=NAMESPACE))
            live[name] = (fed, caches)
            written, reused = written + info.bytes_written, reused + info.bytes_reused
            rows.append((f"save {name} ({len(fed)} tok)", "-", _kib(info.bytes_written),
                         _kib(info.bytes_reused) + " dedup", f"prefill {_ms(seconds)}, save {_ms(save_s)}"))
        facts.update(bytes_written=written, bytes_reused=reused)

        # 2. a restart: restore chat-1 instead of recomputing its prefill, continue, compare with never stopping
        fed, live_caches = live["chat-1"]
        read0 = _bytes_read(store)
        restored, restore_s = _timed(lambda: store.restore("chat-1", namespace=NAMESPACE))
        restore_read = _bytes_read(store) - read0
        _eval_caches(restored.caches)
        assert list(restored.tokens) == fed and restored.length == len(fed)
        _, recompute_s = _timed(lambda: _prefill(model, fed, model.make_caches()))
        turn = _tokens(200, 24, vocab)
        from_restored = _prefill(model, turn, restored.caches)
        never_stopped = _prefill(model, turn, live_caches)
        logits_equal = _same_bits(from_restored, never_stopped)
        if not logits_equal:
            raise AssertionError("logits continuing from the restored caches differ from never stopping")
        facts.update(logits_equal=logits_equal, restore_seconds=restore_s, recompute_seconds=recompute_s,
                     restored_tokens=restored.length)
        rows.append((f"restore chat-1 ({restored.length} tok)", str(restored.length), "-",
                     _kib(restore_read) + " read",
                     f"{_ms(restore_s)} vs prefill {_ms(recompute_s)} ({recompute_s / restore_s:,.0f}x)"))
        out(f"continuing chat-1 from restored caches: logits bit-identical to never stopping: {logits_equal}")

        # 3. a new chat reuses the stored system prompt and prefills only its own turn
        prompt = system + _tokens(300, 150, vocab)
        hit, lookup_s = _timed(lambda: store.lookup(prompt, namespace=NAMESPACE))
        read0 = _bytes_read(store)
        prefix, prefix_s = _timed(lambda: store.restore_prefix(prompt, namespace=NAMESPACE))
        prefix_read = _bytes_read(store) - read0
        if hit is None or prefix is None:
            raise AssertionError("the stored system prompt was not found for the new chat")
        _eval_caches(prefix.caches)
        rest, rest_s = _timed(lambda: _prefill(model, prompt[prefix.length:], prefix.caches))
        full, full_s = _timed(lambda: _prefill(model, prompt, model.make_caches()))
        drift = float(mx.max(mx.abs(rest - full)).item())
        facts.update(prefix_tokens=prefix.length, prefix_bytes_read=prefix_read, restore_bytes_read=restore_read, prefix_from=hit.session_id, lookup_seconds=lookup_s,
                     prefix_logits_max_abs_diff=drift)
        rows.append((f"new chat, prefix ({len(prompt)} tok)", str(prefix.length), "-",
                     _kib(prefix_read) + " read",
                     f"{_ms(lookup_s + prefix_s + rest_s)} vs prefill {_ms(full_s)} (lookup {_ms(lookup_s)})"))
        agreement = "bit-identical" if drift == 0.0 else f"within {drift:.2e} (a different prefill split rounds differently)"
        out(f"new chat: reused {prefix.length} of {len(prompt)} prompt tokens from {hit.session_id}, prefilled the "
            f"other {len(prompt) - prefix.length}; logits vs a full prefill: {agreement}")

        # 4. two sessions restored straight into one batch; each row is bit-identical to its live caches
        read0 = _bytes_read(store)
        batch, batch_s = _timed(lambda: store.restore_batch([("chat-2", NAMESPACE), ("chat-3", NAMESPACE)]))
        _eval_caches(batch.caches)
        rows_exact = True
        for row, name in enumerate(["chat-2", "chat-3"]):
            expect = live[name][1]
            for layer, cache in enumerate(batch.caches):
                got_entry, got = default_provider.for_cache(row_cache := cache.extract_row(row)).snapshot(row_cache)
                want_entry, want = default_provider.for_cache(expect[layer]).snapshot(expect[layer])
                rows_exact &= got_entry.offset == want_entry.offset and all(
                    _same_bits(a, b) for a, b in zip(got, want, strict=True))
        if not rows_exact:
            raise AssertionError("a batch row differs from the live caches it was saved from")
        step = mx.array([[live["chat-2"][0][-1]], [live["chat-3"][0][-1]]], dtype=mx.int32)
        batch_logits = model(step, batch.caches)
        mx.eval(batch_logits)
        facts.update(batch_lengths=list(batch.lengths), batch_rows_exact=rows_exact)
        rows.append(("restore_batch chat-2 + chat-3", str(sum(batch.lengths)), "-",
                     _kib(_bytes_read(store) - read0) + " read", f"{_ms(batch_s)}, {len(batch.lengths)} rows bit-exact"))

    facts["tokens_reused"] = facts["restored_tokens"] + facts["prefix_tokens"] + sum(facts["batch_lengths"])
    facts["seconds"] = time.perf_counter() - started
    table = Table(title="kvshelf demo", title_justify="left")
    for column in ("step", "tokens reused", "bytes written", "bytes reused", "time"):
        table.add_column(column, justify="left" if column in ("step", "time") else "right")
    for row_values in rows:
        table.add_row(*row_values)
    table.add_row("total", f"{facts['tokens_reused']:,}", _kib(facts["bytes_written"]),
                  _kib(facts["bytes_reused"]) + " dedup", f"{facts['seconds']:.2f} s")
    out(_render(table))
    return facts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvshelf demo", description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store directory (default: the embedded default store)")
    args = parser.parse_args(argv)
    run_demo(args.store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
