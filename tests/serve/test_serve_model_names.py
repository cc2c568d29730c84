"""Which ``model`` a client sends: ``GET /v1/models`` lists the served model under one name (the model directory's),
and that name, ``"default"`` and the ``--model`` path all reach it, through the official ``openai`` client, on a host
without any Hugging Face cache (mlx-lm's own listing scanned it: an empty body and a traceback)."""

from __future__ import annotations

import pytest

import openai
from serve_harness import Server, conversation
from tiny_model_dir import make_model_dir, words


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=0)


def test_the_listed_name_and_default_are_served_without_a_hugging_face_cache(model, tmp_path):
    no_cache = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hf-home" / "hub")}
    with Server(model, tmp_path / "store", tmp_path / "a.log", env=no_cache) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0,
                               timeout=300)
        listed = [m.id for m in client.models.list()]
        assert listed == ["tiny-llama"]
        assert client.models.retrieve("tiny-llama").id == "tiny-llama"
        msgs = conversation(words(40), ["hello world"], [])
        texts = {name: client.chat.completions.create(model=name, messages=msgs, max_tokens=4,
                                                      temperature=0.0).choices[0].message.content
                 for name in ("tiny-llama", "default", str(model), "default_model")}
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("another-model")
        log = server.log()
    assert len(set(texts.values())) == 1, texts
    assert "Traceback" not in log and "huggingface" not in log.lower(), log
