"""Every PromQL expression docs/OPERATING.md gives an operator returns a non-empty vector from a real Prometheus
(Debian's 2.42, on loopback, scraping every second) that scrapes real ``kvshelf serve`` processes: one that wrote
a prompt, one that served it from the store. A documented query that matches nothing (a vector match without
``sum()`` on both sides, a series that is never exported) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prometheus_server import Prometheus
from serve_harness import Server, conversation
from tiny_model_dir import make_model_dir, words

DOC = Path(__file__).resolve().parents[2] / "docs" / "OPERATING.md"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def documented_queries() -> list[str]:
    """The backticked expressions of the "Watch" section that name a kvshelf metric."""
    text = DOC.read_text()
    section = text.split("\n## Watch", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"`([^`\n]*kvshelf_[a-z_]+[^`\n]*)`", section)
    return list(dict.fromkeys(found))


def test_the_documented_queries_are_found():
    queries = documented_queries()
    assert len(queries) >= 10, queries
    assert any(q.startswith("sum(rate(kvshelf_cached_tokens_total") for q in queries)


def test_every_documented_query_returns_a_non_empty_vector(model, tmp_path):
    store = tmp_path / "store"
    msgs = conversation(words(150), ["hello world"], [])
    with Server(model, store, tmp_path / "a.log") as writer, Server(model, store, tmp_path / "b.log") as reader:
        r = writer.chat(msgs)
        writer.wait_log(rf"kvshelf write-behind saved tokens={r['prompt_tokens'] + r['completion_tokens']}\b")
        reader.chat(msgs)
        assert reader.prefix_lines()[-1]["source"] == "disk"
        targets = [f"127.0.0.1:{writer.port}", f"127.0.0.1:{reader.port}"]
        with Prometheus(tmp_path / "prometheus", targets) as prom:
            # enough scrapes of both servers for rate() over any window: three samples of every target's series
            ready = prom.wait_for("count_over_time(kvshelf_prompt_tokens_total[5m]) >= 3",
                                  lambda result: len(result) == 2)
            assert len(ready) == 2, prom.query("up")
            empty = {q: prom.query(q) for q in documented_queries()}
    empty = [q for q, result in empty.items() if not result]
    assert empty == [], f"documented queries returning nothing: {empty}"
