"""Hits that mean something (``--min-hit-tokens``): after a restart, half the requests are disk hits and half are
new prompts whose only "cached" tokens are the chat template's lead-in in RAM. ``/metrics`` and the status page
say 50% of requests hit, and the cold half keeps the store's own miss reason. Real server processes on 127.0.0.1,
the official ``openai`` client."""

from __future__ import annotations

import http.client
import json
import re

import pytest

import openai
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import Server, conversation
from tiny_model_dir import WORDS, make_model_dir, words

from kvshelf.mlx_lm.serve.prompt_cache import MISS_REASONS

N = 4  # prompts stored before the restart; as many new ones after it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def get(server: Server, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    assert resp.status == 200, body
    return body


def metrics(server: Server) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(get(server, "/metrics")) for s in family.samples}


def ask(server: Server, messages: list[dict]) -> dict:
    raw = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0,
                        timeout=300).chat.completions.with_raw_response.create(
        model="default_model", messages=messages, max_tokens=4, temperature=0.0)
    completion = raw.parse()
    fields = dict(part.split("=") for part in raw.headers["x-kvshelf-prefix"].split())
    return {**fields, "total": completion.usage.prompt_tokens + completion.usage.completion_tokens}


def prompt(i: int) -> list[dict]:
    # each system prompt starts with another word: two prompts share only the template's lead-in
    return conversation(f"{WORDS[i]} " + words(120, salt=i), ["hello world"], [])


def cells(page: str, table: str) -> list[list[str]]:
    body = re.search(rf"<table class=['\"]{table}['\"]>(.*?)</table>", page, re.S)
    assert body, page
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S) if "<td>" in row]


def test_half_cold_half_disk_hits_read_fifty_percent_with_the_cold_reasons(model, tmp_path):
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "a.log") as first:
        totals: list[int] = []
        for i in range(N):  # each one's write-behind done (prompts of one length: count the lines of that length)
            totals.append(ask(first, prompt(i))["total"])
            first.wait_log(rf"kvshelf write-behind saved tokens={totals[-1]}\b", count=totals.count(totals[-1]))
    with Server(model, store, tmp_path / "b.log") as server:
        heads = []
        for i in range(N):  # interleaved: a stored prompt, then a new one (whose lead-in RAM now holds)
            heads.append(ask(server, prompt(i)))
            heads.append(ask(server, prompt(N + i)))
        lines = server.prefix_lines()
        log = server.log()
        m = metrics(server)
        doc = json.loads(get(server, "/kvshelf/stats"))
        page = get(server, "/kvshelf")
    hits, cold = heads[0::2], heads[1::2]
    assert [h["source"] for h in hits] == ["disk"] * N
    assert [h["source"] for h in cold] == ["none"] * N
    # the bug this guards against: the new prompts did get a trivial RAM prefix (the template's lead-in)
    ram_lens = [int(x) for x in re.findall(r"kvshelf prefix source=none cached=\d+ prompt=\d+ ram=(\d+)", log)]
    assert len(ram_lens) == N and any(0 < r < 16 for r in ram_lens), log
    assert len(lines) == 2 * N
    requests = {s: m[("kvshelf_requests_total", (("source", s),))] for s in ("ram", "disk", "remote", "none")}
    assert requests == {"ram": 0, "disk": N, "remote": 0, "none": N}
    hit_rate = 1 - requests["none"] / sum(requests.values())
    assert abs(hit_rate - 0.5) <= 1 / (2 * N)
    # the cold requests' real reasons: what the store said, never an empty or trivial-RAM one
    reasons = {r: m[("kvshelf_misses_total", (("reason", r),))] for r in MISS_REASONS}
    assert sum(reasons.values()) == N
    cold_reasons = re.findall(r"kvshelf prefix source=none .*? reason=(\w+)", log)
    assert len(cold_reasons) == N and set(cold_reasons) <= set(MISS_REASONS)
    # tokens: every prompt token counted once, the disk hits' and the lead-ins' cached tokens by tier
    assert m[("kvshelf_prompt_tokens_total", ())] == sum(int(h["prompt"]) for h in heads)
    assert m[("kvshelf_cached_tokens_total", (("tier", "disk"),))] == sum(int(h["cached"]) for h in hits)
    assert m[("kvshelf_cached_tokens_total", (("tier", "ram"),))] == sum(ram_lens)
    # the status page: 50% of requests, and the token share labelled as such
    window = doc["hit_rates"]["1m"]
    assert window["requests"] == 2 * N and abs(window["hit"] - 0.5) <= 1 / (2 * N)
    assert window["disk"] == 0.5 and window["ram"] == 0.0
    cached = sum(int(h["cached"]) for h in heads)
    assert window["token_share"] == round(cached / sum(int(h["prompt"]) for h in heads), 4)
    rates = {row[0]: row for row in cells(page, "rates")}
    assert rates["1m"][1] == str(2 * N) and rates["1m"][2] == "50.0%"
    assert "Hit rates by requests" in page and "Hit rates by tokens" in page
    tokens = {row[0]: row for row in cells(page, "token-rates")}
    assert tokens["1m"][3] == f"{100 * window['token_share']:.1f}%"
    assert doc["misses"] == {r: int(v) for r, v in reasons.items() if v}
