"""``kvshelf serve`` generations that survive a crash, as a client sees them (official ``openai`` client).

A long answer (600 tokens, EOS biased away so it runs to ``max_tokens``), greedy or sampled with an explicit seed,
streamed or not: the server is SIGKILLed once a checkpoint is durable (its log line), a restarted server answers the
identical retried request with exactly the text a server that was never killed gives, its log shows the resume from
that checkpoint, and the completed request leaves no checkpoint in the store. A different request (another seed,
``max_tokens``, stop sequence or system prompt) never resumes from it.
"""

from __future__ import annotations

import re
import threading

import pytest

import openai

from serve_harness import Server
from test_serve_metrics import metrics
from tiny_model_dir import EOS, VOCAB, make_model_dir, words

from kvshelf import open_store
from kvshelf.mlx_lm import model_identity
from kvshelf.store.generations import NAMESPACE_PREFIX

MAX_TOKENS = 600
CHECKPOINT = re.compile(r"kvshelf generation checkpoint tokens=(?P<tokens>\d+) generated=(?P<generated>\d+) "
                        r"key=(?P<key>[0-9a-f]{64})")
RESUME = re.compile(r"kvshelf resume from=(?P<generated>\d+) of max_tokens=(?P<max>\d+)")
DROPPED = re.compile(r"kvshelf generation checkpoints dropped count=(?P<count>\d+) key=(?P<key>[0-9a-f]{64})")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """A kvshelf server that is never killed: the answers an uninterrupted run gives."""
    root = tmp_path_factory.mktemp("reference")
    with Server(model, root / "store", root / "ref.log") as server:
        yield server


def request(system: str = words(120), *, seed: int | None = None, temperature: float = 0.0,
            max_tokens: int = MAX_TOKENS, stop: list[str] | None = None) -> dict:
    body = {"model": "default_model", "max_tokens": max_tokens, "temperature": temperature,
            "logit_bias": {str(VOCAB.index(EOS)): -100.0},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "tell me a long story"}]}
    if seed is not None:
        body["seed"] = seed
    if stop is not None:
        body["stop"] = stop
    return body


def ask(server: Server, body: dict, stream: bool, headers: dict | None = None) -> dict:
    """The answer as the official client assembles it: text, finish reason, completion tokens (non-streaming)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0,
                           timeout=600, default_headers=headers)
    if not stream:
        r = client.chat.completions.create(**body)
        return {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
                "completion_tokens": r.usage.completion_tokens}
    parts, finish = [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"text": "".join(parts), "finish": finish}


def checkpoint_sessions(model, store) -> list:
    with open_store(store, identity=model_identity(model)) as s:
        return [x for x in s.sessions() if x.namespace.startswith(NAMESPACE_PREFIX)]


def ask_and_wait_dropped(server: Server, body: dict, stream: bool) -> dict:
    before = len(DROPPED.findall(server.log()))
    answer = ask(server, body, stream)
    server.wait_log(DROPPED, count=before + 1)
    return answer


def kill_after_checkpoint(model, store, log_path, body: dict, stream: bool, headers: dict | None = None) -> int:
    """Start the request on a fresh server and SIGKILL it once a checkpoint is durable; its generated count."""
    victim = Server(model, store, log_path)
    failed: list = []

    def doomed():
        try:
            if ask(victim, body, stream, headers)["finish"] is not None:  # a cut stream just ends, unfinished
                failed.append("the request completed before the kill")
        except (openai.APIError, OSError):
            pass  # the server died under it: what a client of a crashed server sees

    thread = threading.Thread(target=doomed, daemon=True)
    thread.start()
    try:
        line = victim.wait_log(CHECKPOINT)[0]
    finally:
        victim.kill()
    thread.join(timeout=120)
    assert not failed, failed
    return int(line["generated"])


CASES = [pytest.param(False, None, 0.0, id="greedy"), pytest.param(True, None, 0.0, id="greedy-stream"),
         pytest.param(False, 1234, 0.8, id="seeded"), pytest.param(True, 1234, 0.8, id="seeded-stream")]


@pytest.mark.parametrize(("stream", "seed", "temperature"), CASES)
def test_a_retried_request_resumes_after_sigkill_and_answers_identically(model, reference, tmp_path, stream, seed,
                                                                          temperature):
    body = request(seed=seed, temperature=temperature)
    want = ask_and_wait_dropped(reference, body, stream)
    assert want["finish"] == "length"
    store = tmp_path / "store"
    generated = kill_after_checkpoint(model, store, tmp_path / "victim.log", body, stream)
    assert generated >= 256
    assert [s.length for s in checkpoint_sessions(model, store)]  # the durable checkpoint outlived the process

    with Server(model, store, tmp_path / "restarted.log") as restarted:
        got = ask_and_wait_dropped(restarted, body, stream)
        assert got == want
        resumes = RESUME.findall(restarted.log())
        assert resumes and int(resumes[-1][0]) >= 256 and int(resumes[-1][1]) == MAX_TOKENS
        assert checkpoint_sessions(model, store) == []  # the completed request dropped its checkpoints
        seen = metrics(restarted)  # what an operator's scrape shows of it
        assert seen[("kvshelf_generation_resumes_total", ())] == 1
        assert seen[("kvshelf_generation_resumed_tokens_total", ())] == int(resumes[-1][0])
        assert seen[("kvshelf_generation_checkpoints_total", (("outcome", "dropped"),))] >= 1


def test_a_request_too_short_to_reach_a_checkpoint_stays_in_mlx_lms_batch(reference):
    """``max_tokens`` at or below the interval never writes a checkpoint and can never resume: it is left to
    mlx-lm's batch (counted), not served one at a time."""
    before = metrics(reference)
    got = ask(reference, request(max_tokens=200), False)
    after = metrics(reference)
    assert got["finish"] == "length" and got["completion_tokens"] == 200
    key = ("kvshelf_generation_requests_short_total", ())
    assert after[key] == before.get(key, 0) + 1
    queued = ("kvshelf_generation_checkpoints_total", (("outcome", "queued"),))
    assert after[queued] == before[queued]


def test_a_different_request_never_resumes_from_that_checkpoint(model, reference, tmp_path):
    body = request(seed=7, temperature=0.8)
    store = tmp_path / "store"
    kill_after_checkpoint(model, store, tmp_path / "victim.log", body, False)
    others = {
        "another seed": request(seed=8, temperature=0.8),
        "another max_tokens": request(seed=7, temperature=0.8, max_tokens=MAX_TOKENS - 1),
        "a stop sequence": request(seed=7, temperature=0.8, stop=["zebra"]),
        "another system prompt": request(words(120, salt=3), seed=7, temperature=0.8),
    }
    with Server(model, store, tmp_path / "restarted.log") as restarted:
        for name, other in others.items():
            got = ask_and_wait_dropped(restarted, other, False)
            assert not RESUME.search(restarted.log()), name
            assert got == ask_and_wait_dropped(reference, other, False), name
        assert checkpoint_sessions(model, store)  # still there for its own request
        assert ask_and_wait_dropped(restarted, body, False) == ask_and_wait_dropped(reference, body, False)
        assert RESUME.search(restarted.log())


def test_a_tenants_generation_checkpoints_are_filed_as_its_own_and_go_with_forget_tenant(model, tmp_path):
    """A tenant's running generation is its data: its checkpoints are filed in its namespace, so
    ``forget_tenant`` removes them (and the default tenant's sessions never list them)."""
    store = tmp_path / "store"
    kill_after_checkpoint(model, store, tmp_path / "victim.log", request(), False, {"X-Kvshelf-Tenant": "acme"})
    with open_store(store, identity=model_identity(model)) as s:
        theirs = [x for x in s.sessions(tenant="acme") if NAMESPACE_PREFIX in x.namespace]
        assert theirs, "the checkpoint is not filed under its tenant"
        assert not [x for x in s.sessions(tenant="") if NAMESPACE_PREFIX in x.namespace]
        assert s.forget_tenant("acme")
    assert checkpoint_sessions(model, store) == []
