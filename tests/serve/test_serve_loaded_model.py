"""A model whose constructor builds arrays outside its parameters (Llama 3.1's scaled RoPE frequencies) is served.

Why: ``kvshelf serve`` loads the default model in the main thread (start-up checks) and mlx-lm generates in its own
thread; MLX streams are per thread, so an array left lazy at load made the generation thread die on the first
request ("There is no Stream(cpu, 0) in current thread") where plain ``mlx_lm.server`` answers. Real servers on
127.0.0.1, the official ``openai`` client.
"""

from __future__ import annotations

import openai

from serve_harness import Server, conversation
from tiny_model_dir import make_model_dir, words


def reply(server: Server, messages: list[dict]) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=300)
    doc = client.chat.completions.create(model="default_model", messages=messages, max_tokens=6, temperature=0.0)
    return doc.choices[0].message.content


def test_a_model_with_arrays_outside_its_parameters_is_served_as_plain_mlx_lm_serves_it(tmp_path):
    model = make_model_dir(tmp_path / "llama31", "llama-rope-scaled", seed=0)
    msgs = conversation(words(300), ["hello"], [])
    with Server(model, None, tmp_path / "plain.log") as plain:
        expected = reply(plain, msgs)
    with Server(model, tmp_path / "store", tmp_path / "kvshelf.log") as server:
        assert reply(server, msgs) == expected
        server.wait_log(r"kvshelf write-behind saved tokens=\d+")
    with Server(model, tmp_path / "store", tmp_path / "again.log") as again:  # and from disk after a restart
        assert reply(again, msgs) == expected
        assert again.prefix_lines()[-1]["source"] == "disk"
