"""Resumable requests decoded inside mlx-lm's batch, checkpointed and resumed as rows of it (``batch_rows.py``),
as clients see them (official ``openai`` client, real ``kvshelf serve`` processes, SIGKILL).

Four concurrent long answers (EOS biased away so they run to ``max_tokens``), greedy or sampled with a seed each:
the server is SIGKILLed once every one of them has a durable checkpoint, a restarted server answers the four
identical retried requests (again concurrently) with exactly the texts an uninterrupted server gave the same four
concurrent requests, resuming each from its checkpoint. A kill at the write of a row's first, second or third
checkpoint resumes that row from the one before. The counting test shows concurrent requests really are decoded as
rows of one batch (mlx-lm's batch reported all of them in one step).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import dying_serve
import openai

from serve_harness import Server
from test_serve_metrics import metrics
from test_serve_resume import CHECKPOINT, DROPPED, ask, checkpoint_sessions, request
from tiny_model_dir import make_model_dir, words

EVERY = 128
MAX_TOKENS = 1536
EXTRA = ("--generation-checkpoint-every", str(EVERY))
RESUME = re.compile(r"kvshelf resume from=(?P<generated>\d+) of max_tokens=(?P<max>\d+) key=(?P<key>[0-9a-f]{64})")
DIED = re.compile(r"test launcher: SIGKILL at generation checkpoint generated=(?P<generated>\d+) "
                  r"key=(?P<key>[0-9a-f]{64})")
LAUNCHER = Path(dying_serve.__file__)


def bodies(kind: str, n: int = 4) -> list[dict]:
    """``n`` different requests (another system prompt each); ``seeded``: temperature 0.8, a seed each."""
    if kind == "greedy":
        return [request(words(60 + 10 * i, salt=i), max_tokens=MAX_TOKENS) for i in range(n)]
    return [request(words(60 + 10 * i, salt=i), seed=100 + i, temperature=0.8, max_tokens=MAX_TOKENS)
            for i in range(n)]


def ask_all(server: Server, asked: list[dict]) -> list[dict]:
    """The requests sent at once (odd ones streamed); their answers, in order, once every completed request dropped
    its checkpoints."""
    before = len(DROPPED.findall(server.log()))
    with ThreadPoolExecutor(len(asked)) as pool:
        answers = list(pool.map(lambda ib: ask(server, ib[1], bool(ib[0] % 2)), enumerate(asked)))
    server.wait_log(DROPPED, count=before + len(asked))
    return answers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """A kvshelf server that is never killed; ``answers[kind]``: what it gave the four concurrent requests."""
    root = tmp_path_factory.mktemp("reference")
    with Server(model, root / "store", root / "ref.log", extra=EXTRA) as server:
        server.answers = {}
        yield server


def uninterrupted(reference: Server, kind: str) -> list[dict]:
    if kind not in reference.answers:
        reference.answers[kind] = ask_all(reference, bodies(kind))
        assert all(a["finish"] == "length" for a in reference.answers[kind])
    return reference.answers[kind]


def start_and_kill(server: Server, asked: list[dict], until) -> None:
    """Send ``asked`` at once and SIGKILL the server when ``until()`` holds (it waits on log lines); every request
    must have been cut by the kill."""
    failed: list = []

    def doomed(i: int, body: dict) -> None:
        try:
            if ask(server, body, bool(i % 2))["finish"] is not None:  # a cut stream just ends, unfinished
                failed.append(f"request {i} completed before the kill")
        except (openai.APIError, OSError):
            pass  # the server died under it

    threads = [threading.Thread(target=doomed, args=(i, b), daemon=True) for i, b in enumerate(asked)]
    for t in threads:
        t.start()
    try:
        until()
    finally:
        server.kill()
    for t in threads:
        t.join(timeout=120)
    assert not failed, failed


def durable(log: str) -> dict[str, int]:
    """The last durable checkpoint of each key in a server's log (its generated count)."""
    out: dict[str, int] = {}
    for m in CHECKPOINT.finditer(log):
        out[m["key"]] = max(out.get(m["key"], 0), int(m["generated"]))
    return out


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_four_batched_requests_resume_after_sigkill_and_answer_identically(model, reference, tmp_path, kind):
    want = uninterrupted(reference, kind)
    asked = bodies(kind)
    store = tmp_path / "store"
    victim = Server(model, store, tmp_path / "victim.log", extra=EXTRA)

    def every_row_has_a_checkpoint() -> None:
        while len(durable(victim.log())) < len(asked):
            victim.wait_log(CHECKPOINT, count=sum(1 for _ in CHECKPOINT.finditer(victim.log())) + 1)

    start_and_kill(victim, asked, every_row_has_a_checkpoint)
    left = durable(victim.log())
    assert len(left) == 4 and min(left.values()) >= EVERY
    assert len(checkpoint_sessions(model, store)) >= 4  # the durable checkpoints outlived the process

    with Server(model, store, tmp_path / "restarted.log", extra=EXTRA) as restarted:
        got = ask_all(restarted, asked)
        assert got == want
        resumed = {m["key"]: int(m["generated"]) for m in RESUME.finditer(restarted.log())}
        assert set(resumed) == set(left)  # all four resumed, each from its own last durable checkpoint or later
        assert all(resumed[k] >= left[k] for k in left)
        assert checkpoint_sessions(model, store) == []  # the completed requests dropped their checkpoints
        seen = metrics(restarted)
        assert seen[("kvshelf_generation_resumes_total", ())] == 4
        assert seen[("kvshelf_generation_requests_batched_total", ())] == 4


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_kill_at_each_checkpoint_write_of_a_batched_row_resumes_from_the_previous_one(model, reference, tmp_path,
                                                                                       nth):
    """A row of a two-row batch (one greedy, one seeded) dies at the write of its ``nth`` checkpoint: the retry
    resumes it from checkpoint ``nth - 1`` (starts over for the first) and both answers equal the uninterrupted
    ones."""
    asked = [bodies("greedy")[0], bodies("seeded")[1]]
    want = [uninterrupted(reference, "greedy")[0], uninterrupted(reference, "seeded")[1]]
    store = tmp_path / "store"
    victim = Server(model, store, tmp_path / "victim.log", extra=EXTRA, launcher=LAUNCHER,
                    env={dying_serve.DIE_ENV: str(nth * EVERY)})
    start_and_kill(victim, asked, lambda: victim.wait_log(DIED))
    died = DIED.search(victim.log())
    assert int(died["generated"]) == nth * EVERY
    left = durable(victim.log())
    assert left.get(died["key"], 0) == (nth - 1) * EVERY  # the write before it was durable, that one never was

    with Server(model, store, tmp_path / "restarted.log", extra=EXTRA) as restarted:
        got = ask_all(restarted, asked)
        assert [got[0], got[1]] == want
        resumed = {m["key"]: int(m["generated"]) for m in RESUME.finditer(restarted.log())}
        assert resumed.get(died["key"], 0) == (nth - 1) * EVERY  # the resume point is in the log
        assert checkpoint_sessions(model, store) == []


def test_concurrent_resumable_requests_are_rows_of_one_batch(model, tmp_path):
    """Six concurrent checkpointed requests (greedy and seeded mixed) are decoded together: one step of mlx-lm's
    batch reported all six (not one at a time), and though they reach their first checkpoint in the same step, every
    one of those was written (a later one may still be skipped while the row's previous write is in flight)."""
    asked = [*bodies("greedy", 3), *bodies("seeded", 6)[3:]]
    with Server(model, tmp_path / "store", tmp_path / "server.log", extra=EXTRA) as server:
        assert metrics(server)[("kvshelf_generation_batch_rows_peak", ())] == 0
        answers = ask_all(server, asked)
        seen = metrics(server)
        assert all(a["finish"] == "length" for a in answers)
        assert seen[("kvshelf_generation_requests_batched_total", ())] == 6
        assert seen[("kvshelf_generation_batch_rows_peak", ())] == 6
        first = {m["key"] for m in CHECKPOINT.finditer(server.log()) if int(m["generated"]) == EVERY}
        assert len(first) == 6  # all six first checkpoints, taken in one step, were written (none found a full queue)
