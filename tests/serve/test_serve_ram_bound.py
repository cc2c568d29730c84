"""Bounded memory: ``--prompt-cache-bytes`` holds the RAM tier within its bound under a stream of distinct long
prompts (counted in bytes from ``/metrics``, never timed), the store keeps what RAM drops, and an allocation
failure while inserting into RAM (injected with ``KVSHELF_FAULT_RAM_INSERT``, as MLX raises it) is survived and
counted. Real server processes on 127.0.0.1."""

from __future__ import annotations

import http.client

import pytest

from prometheus_client.parser import text_string_to_metric_families
from serve_harness import Server, kvshelf_cli
from tiny_model_dir import WORDS, make_model_dir, words

from kvshelf.mlx_lm.serve.ram_tier import EVICTION_REASONS

# The figures are 200 prompts of ~2k tokens against 64 MiB. The tiny model's cache is ~2 KiB per token
# (float32, 2 layers, one 32-wide KV head, mlx-lm's 256-token steps), so 200 x 2k tokens would be ~800 MiB; kept
# at the same ratio (the prompts' caches about 12x the bound) with prompts of ~512 tokens and a 4 MiB bound,
# which the 2 shared cores of CI run in a minute.
PROMPTS = 200
PROMPT_WORDS = 500
BOUND = 4 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


def metrics(server: Server) -> dict[tuple[str, tuple], float]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def ram_evictions(m: dict) -> dict[str, float]:
    return {r: m[("kvshelf_evictions_total", (("reason", r), ("tier", "ram")))] for r in EVICTION_REASONS}


def distinct(i: int, n: int = PROMPT_WORDS) -> list[dict]:
    # two words naming i (128 x 128 prompts at most), then a long body: no two prompts share more than the lead-in
    return [{"role": "user", "content": f"{WORDS[i % len(WORDS)]} {WORDS[i // len(WORDS)]} " + words(n, salt=i)}]


def test_the_ram_tier_never_holds_more_than_its_bound(model, tmp_path):
    store = tmp_path / "store"
    extra = ("--prompt-cache-bytes", str(BOUND), "--prompt-cache-size", "100000")
    seen = []
    with Server(model, store, tmp_path / "a.log", extra=extra) as server:
        for i in range(PROMPTS):
            server.chat(distinct(i), max_tokens=1)
            m = metrics(server)
            seen.append(m[("kvshelf_ram_bytes", ())])
        m = metrics(server)
        log = server.log()
        lines = server.prefix_lines()
    assert m[("kvshelf_ram_budget_bytes", ())] == BOUND
    assert max(seen) <= BOUND and m[("kvshelf_ram_peak_bytes", ())] <= BOUND
    assert max(seen) > BOUND // 2  # the bound was reached, and it is what held the tier
    evicted = ram_evictions(m)
    assert evicted["bytes"] > 0 and evicted["allocation_failure"] == 0
    # what left RAM is still the store's: the tier held a fraction of what the prompts' caches were
    assert len(lines) == PROMPTS and all(line["source"] == "none" for line in lines)
    assert m[("kvshelf_prompt_tokens_total", ())] >= PROMPTS * PROMPT_WORDS
    assert m[("kvshelf_bytes_written_total", ())] > 4 * BOUND  # the store took what RAM could not hold
    assert "Traceback" not in log


def test_an_allocation_failure_on_insert_is_survived_and_counted(model, tmp_path):
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "a.log", env={"KVSHELF_FAULT_RAM_INSERT": "3"},
                extra=("--prompt-cache-bytes", str(BOUND))) as server:
        replies = [server.chat(distinct(i, 100), max_tokens=2) for i in range(4)]
        server.wait_log("kvshelf RAM tier: allocation failed while inserting")
        again = server.chat(distinct(3, 100), max_tokens=2)  # served, and the tier works again afterwards
        m = metrics(server)
        log = server.log()
        assert server.proc.poll() is None
    assert all(r["completion_tokens"] >= 1 for r in replies) and again["completion_tokens"] >= 1
    evicted = ram_evictions(m)
    assert evicted["allocation_failure"] >= 1
    assert log.count("kvshelf RAM tier: allocation failed while inserting") == 1
    assert "MemoryError: injected by KVSHELF_FAULT_RAM_INSERT=3" in log
    assert m[("kvshelf_ram_bytes", ())] > 0  # inserts after the failure are kept again


def test_help_states_the_default_bound():
    done = kvshelf_cli("serve", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "--prompt-cache-bytes N" in text and "default: 25% of physical memory" in text, text
    assert "--min-hit-tokens N" in text
