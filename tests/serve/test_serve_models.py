"""Caches other than plain KVCache survive a ``kvshelf serve`` restart: a hybrid model (qwen3_next: attention +
GatedDeltaNet, i.e. KVCache + ArraysCache layers), a pure state-space model (mamba2: ArraysCache) and a quantized-KV
server (``--kv-bits``: QuantizedKVCache, mlx-lm's sequential path). Each is served, SIGKILLed after its
write-behinds, restarted on its store and continued: the replies are those of a server that never stopped, and the
restarted one took its prefix from disk."""

from __future__ import annotations

import json

import pytest

from serve_harness import Server, conversation, kvshelf_cli
from tiny_model_dir import make_model_dir, words

SYSTEM = words(150)
TURNS = ["hello world what is the cache", "and the disk of the store", "one more short question"]
QUANT = ("--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0")
CASES = {
    "qwen3_next": ("qwen3_next", (), {"mlx-lm.kv", "mlx-lm.arrays"}),
    "mamba2": ("mamba2", (), {"mlx-lm.arrays"}),
    "kv-bits": ("llama", QUANT, {"mlx-lm.qkv"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_served_restarted_and_continued_with_identical_replies(case, tmp_path):
    arch, extra, kinds = CASES[case]
    model = make_model_dir(tmp_path / arch, arch, seed=5)
    store = tmp_path / "store"
    with Server(model, None, tmp_path / "ref.log", extra=extra) as ref:
        msgs1 = conversation(SYSTEM, TURNS[:1], [])
        with Server(model, store, tmp_path / "first.log", extra=extra) as first:
            r1 = first.chat(msgs1)
            assert r1["text"] == ref.chat(msgs1)["text"]
            first.wait_log(rf"kvshelf write-behind saved tokens={r1['prompt_tokens'] + r1['completion_tokens']}\b")
        listing = json.loads(kvshelf_cli("ls", "--store", str(store), "--json").stdout)
        assert kinds <= {k for s in listing["sessions"] for k in s["kinds"]}, listing

        with Server(model, store, tmp_path / "restarted.log", extra=extra) as restarted:
            replies, reused = [r1["text"]], []
            for n in (2, 3):
                msgs = conversation(SYSTEM, TURNS[:n], replies)
                want, got = ref.chat(msgs), restarted.chat(msgs)
                assert got["text"] == want["text"]
                replies.append(got["text"])
                reused.append(want["cached_tokens"])
            first_line = restarted.prefix_lines()[0]  # as much from disk as the never-stopped server had in RAM
            assert first_line["source"] == "disk" and first_line["cached"] == reused[0] > len(SYSTEM.split())
