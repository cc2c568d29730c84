"""The status page ``GET /kvshelf`` loaded in a real headless browser (Debian's ``chromium``; ``.ci/run`` installs
it when missing): the rendered page shows the disk hit and the store size, and ``GET /kvshelf/stats`` agrees."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess

import pytest

from serve_harness import Server, conversation
from tiny_model_dir import make_model_dir, words

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SYSTEM = words(200)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def rendered(url: str, profile) -> str:
    """The DOM chromium rendered for ``url`` (headless; a fresh profile; no network besides 127.0.0.1)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=2000",
                          "--dump-dom", url], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "<html" in out.stdout, out.stderr[-2000:]
    return out.stdout


def stats(server: Server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/kvshelf/stats")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return doc


def cells(dom: str, table: str) -> list[list[str]]:
    body = re.search(rf"<table class=\"{table}\">(.*?)</table>", dom, re.S)
    assert body, dom
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S) if "<td>" in row]


def test_the_rendered_status_page_shows_the_disk_hit_and_the_store_size(model, tmp_path):
    store = tmp_path / "store"
    msgs = conversation(SYSTEM, ["hello world"], [])
    with Server(model, store, tmp_path / "a.log") as first:
        r = first.chat(msgs)
        first.wait_log(rf"kvshelf write-behind saved tokens={r['prompt_tokens'] + r['completion_tokens']}\b")
    with Server(model, store, tmp_path / "b.log", extra=("--max-bytes", "64M")) as server:
        r2 = server.chat(conversation(SYSTEM, ["hello world", "and the disk"], [r["text"]]))
        server.wait_log(rf"kvshelf write-behind saved tokens={r2['prompt_tokens'] + r2['completion_tokens']}\b")
        for _ in range(20):  # the page and the JSON of one state: no write-behind finished in between
            doc = stats(server)
            dom = rendered(f"http://127.0.0.1:{server.port}/kvshelf", tmp_path / "profile")
            if stats(server)["store_bytes"] == doc["store_bytes"] and doc["write_queue"]["pending"] == 0:
                break
    assert doc["requests"]["disk"] == 1 and doc["recent"][0]["source"] == "disk"
    assert doc["store_bytes"] > 0 and doc["budget_bytes"] == 64 << 20
    recent = cells(dom, "recent")
    assert recent[0][1] == "disk" and int(recent[0][2]) == doc["recent"][0]["cached"] > 0
    store_rows = dict(cells(dom, "store"))
    size = store_rows["store size"]
    value, unit = size.split()
    scale = {"B": 1, "KiB": 1024, "MiB": 1 << 20}[unit]
    assert abs(float(value) * scale - doc["store_bytes"]) <= 0.05 * scale + 1  # the page's rounding only
    assert store_rows["budget"] == "64.0 MiB"
    assert dict(cells(dom, "requests"))["disk"] == "1"
    rates = {row[0]: row for row in cells(dom, "rates")}
    assert rates["1m"][1] == str(doc["hit_rates"]["1m"]["requests"]) == "1"
    assert "<script" not in dom and "http://" not in dom.split("<body", 1)[1].replace(
        f"127.0.0.1:{server.port}", "")  # no JavaScript, no external asset
