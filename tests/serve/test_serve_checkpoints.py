"""``kvshelf serve --checkpoint-every`` (issue 22): a hybrid model (tiny qwen3_next: recurrent ``ArraysCache`` layers
beside attention) behind a thinking-style chat template (``tiny_model_dir.THINKING_TEMPLATE``, Qwen3's rule): an
agent's tool step keeps its reasoning until the next user message, which re-renders it without. That prompt leaves
the cached sequence inside the previous prompt, before any point mlx-lm's server inserted a cache at (plain mlx-lm
reuses nothing there), so only a checkpoint before the divergence can serve it: the request gets a disk hit of at least the last multiple of 1,024 before the
divergence (the log line says ``checkpoint=yes``, the metric counts it), and both replies equal those of plain
``mlx_lm.server`` (no store). Driven with the official ``openai`` client."""

from __future__ import annotations

import re

import pytest

import openai

from serve_harness import Server
from tiny_model_dir import THINKING_TEMPLATE, make_model_dir, words

SYSTEM = words(40)
FIRST = words(3300, salt=1)
EVERY = 1024


def _chat(server: Server, messages: list[dict]) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                           timeout=300)
    done = client.chat.completions.create(model="default_model", messages=messages, max_tokens=6, temperature=0.0)
    return done.choices[0].message.content, done.usage.prompt_tokens


@pytest.mark.slow
def test_second_turn_of_a_thinking_chat_is_served_from_the_checkpoint_before_the_divergence(tmp_path):
    model = make_model_dir(tmp_path / "qwen3_next", "qwen3_next", seed=3, chat_template=THINKING_TEMPLATE)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST},
             {"role": "assistant", "content": "store find the cache"}, {"role": "tool", "content": "water oil"}]
    with Server(model, None, tmp_path / "ref.log") as ref, \
            Server(model, tmp_path / "store", tmp_path / "serve.log") as served:
        want1, prompt1 = _chat(ref, turn1)
        got1, _ = _chat(served, turn1)
        assert got1 == want1
        # the session (prompt + answer) is written with its checkpoints at 1,024, 2,048 and 3,072
        served.wait_log(r"kvshelf write-behind saved tokens=\d+ .*checkpoints=3")
        turn2 = turn1 + [{"role": "assistant", "content": want1}, {"role": "user", "content": "and the disk"}]
        want2, _ = _chat(ref, turn2)
        got2, prompt2 = _chat(served, turn2)
        assert got2 == want2
        line = served.wait_log(r"kvshelf prefix source=(\w+) cached=(\d+) prompt=" + str(prompt2) + r"\b.*")[-1]
        diverge = len(SYSTEM.split()) + len(FIRST.split())  # about where the tool step's reasoning was
        last_before = (diverge // EVERY) * EVERY
        assert last_before == 3072 and prompt1 > diverge
        assert line.group(1) == "disk" and int(line.group(2)) >= last_before, line.group(0)
        assert "checkpoint=yes" in line.group(0)
        metrics = served._request("GET", "/metrics", None)[1].decode()
        assert re.search(r"^kvshelf_checkpoint_hits_total 1\.0$", metrics, re.M), metrics
