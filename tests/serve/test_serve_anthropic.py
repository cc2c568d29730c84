"""``POST /v1/messages`` with the official ``anthropic`` client against a real ``kvshelf serve`` on 127.0.0.1.

An agent's conversation (a system prompt, two tools, a ``tool_use`` turn and its ``tool_result``) must reach the
same token ids through Anthropic's API as through OpenAI's: the reply equals ``/v1/chat/completions``' for the same
conversation, and the cache it leaves is the other route's to hit. ``usage.cache_read_input_tokens`` is 0 cold,
covers the shared prefix on the next turn, and still does after ``kill -9`` and a restart (the disk tier).
"""

from __future__ import annotations

import json
import re
import time

import anthropic
import openai
import pytest

from serve_harness import Server, conversation, kvshelf_cli
from tiny_model_dir import TOOL_TEMPLATE, make_model_dir, words

SYSTEM = words(400)
TOOLS = [{"name": "find", "description": "find a word", "input_schema": {
              "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
         {"name": "store", "description": "store a word", "input_schema": {
              "type": "object", "properties": {"word": {"type": "string"}}}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


def agent_turns(replies: list[str]) -> list[dict]:
    """Anthropic messages: a question, a tool_use step, its tool_result, then one more user turn per reply."""
    msgs = [{"role": "user", "content": "hello find the water"},
            {"role": "assistant", "content": [{"type": "text", "text": "the cache"},
                                              {"type": "tool_use", "id": "toolu_01", "name": "find",
                                               "input": {"q": "water"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                          "content": [{"type": "text", "text": "oil water disk"}]}]}]
    for n, reply in enumerate(replies):
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": words(30, salt=n + 1)}]
    return msgs


def as_openai(msgs: list[dict]) -> list[dict]:
    """The same conversation as OpenAI chat messages (written out by hand: the test's own oracle)."""
    out = [{"role": "system", "content": SYSTEM}]
    for m in msgs:
        if isinstance(m["content"], str):
            out.append(m)
        elif m["role"] == "assistant":
            out.append({"role": "assistant", "content": "the cache", "tool_calls": [{
                "id": "toolu_01", "type": "function", "function": {"name": "find", "arguments": '{"q": "water"}'}}]})
        else:
            out.append({"role": "tool", "tool_call_id": "toolu_01", "content": "oil water disk"})
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "tools", "llama", seed=3, chat_template=TOOL_TEMPLATE)


def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="any-key", max_retries=0,
                               timeout=300)


def ask(server: Server, msgs: list[dict], *, stream: bool = False, system=SYSTEM) -> anthropic.types.Message:
    kwargs = dict(model="default_model", max_tokens=6, system=system, tools=TOOLS, messages=msgs,
                  extra_body={"temperature": 0.0})  # this SDK release has no temperature argument
    if stream:
        with claude(server).messages.stream(**kwargs) as s:
            events = [e.type for e in s]
            final = s.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
        assert "content_block_start" in events and "content_block_stop" in events
        return final
    return claude(server).messages.create(**kwargs)


def openai_reply(server: Server, msgs: list[dict]) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=300)
    doc = client.chat.completions.create(model="default_model", messages=as_openai(msgs), tools=OPENAI_TOOLS,
                                         max_tokens=6, temperature=0.0)
    return doc.choices[0].message.content


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def prompt_of(message: anthropic.types.Message) -> int:
    u = message.usage
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


def test_messages_match_chat_completions_and_hit_after_kill(model, tmp_path):
    with Server(model, None, tmp_path / "plain.log") as plain:  # the oracle: plain mlx_lm.server, no store
        expected = [openai_reply(plain, agent_turns([])), None]
        expected[1] = openai_reply(plain, agent_turns(["reply"]))

    server = Server(model, tmp_path / "store", tmp_path / "first.log")
    try:
        cold = ask(server, agent_turns([]))
        assert cold.type == "message" and cold.role == "assistant" and cold.stop_reason in ("end_turn", "max_tokens")
        assert text_of(cold) == expected[0]
        assert cold.usage.cache_read_input_tokens == 0 and cold.usage.output_tokens > 0
        first_prompt = prompt_of(cold)
        assert first_prompt > 400

        streamed = ask(server, agent_turns([]), stream=True)  # the same request again, streamed: a RAM hit
        assert text_of(streamed) == expected[0]
        assert streamed.usage.cache_read_input_tokens >= first_prompt - 1

        # the next turn: the whole previous prompt is its shared prefix
        nxt = ask(server, agent_turns(["reply"]))
        assert text_of(nxt) == expected[1]
        assert nxt.usage.cache_read_input_tokens >= first_prompt
        assert openai_reply(server, agent_turns(["reply"])) == expected[1]  # the OpenAI route hits the same cache
        assert server.prefix_lines()[-1]["cached"] >= prompt_of(nxt) - 1
        server.wait_log(r"kvshelf write-behind saved tokens=\d+", count=2)
    finally:
        server.kill()

    with Server(model, tmp_path / "store", tmp_path / "restarted.log") as restarted:
        after = ask(restarted, agent_turns(["reply"]), stream=True)
        assert text_of(after) == expected[1]
        assert after.usage.cache_read_input_tokens >= first_prompt
        assert restarted.prefix_lines()[-1]["source"] == "disk"


def test_bad_bodies_get_anthropic_errors(model, tmp_path):
    with Server(model, tmp_path / "store", tmp_path / "s.log") as server:
        with pytest.raises(anthropic.BadRequestError) as err:
            claude(server).messages.create(model="default_model", max_tokens=4, messages=[{"role": "robot", "content": "x"}])
        assert "role" in str(err.value)
        with pytest.raises(anthropic.BadRequestError):
            claude(server).messages.create(model="default_model", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                           system=[{"type": "text", "text": "s",
                                                    "cache_control": {"type": "ephemeral", "ttl": "2d"}}])
        ok = claude(server).messages.create(model="default_model", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert ok.usage.output_tokens > 0  # the server survived both


def _sessions(store) -> list[dict]:
    listing = json.loads(kvshelf_cli("ls", "--store", str(store), "--json").stdout)
    return listing if isinstance(listing, list) else listing.get("sessions", listing)


def _flood(server: Server, salts: range) -> None:
    for salt in salts:  # other conversations: ~100 KiB per write-behind, past the 600 KiB budget
        server.chat(conversation(words(200, salt=salt), ["what is the cache"], []), max_tokens=2)


def test_cache_control_pins_the_system_prefix_until_its_ttl(model, tmp_path):
    store = tmp_path / "store"
    extra = ("--max-bytes", "600K", "--max-pinned-bytes", "300K")
    system = [{"type": "text", "text": words(300, salt=9), "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": "user", "content": "hello world"}]
    with Server(model, store, tmp_path / "a.log", extra=extra) as server:
        first = ask(server, msgs, system=system)
        pinned = server.wait_log(r"kvshelf cache_control pinned tokens=(\d+) ttl=300 session=(\S+)")[0]
        prefix, session = int(pinned[1]), pinned[2]
        assert 300 < prefix < prompt_of(first)
        assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == prefix
        assert first.usage.input_tokens == prompt_of(first) - prefix
        _flood(server, range(20, 28))
        _settled(server)
        evicted = _metric(server, 'kvshelf_evictions_total{reason="budget",tier="disk"}')
        server.signal(2)
        assert server.wait() == 0
    rows = {r["session_id"]: r for r in _sessions(store)}
    assert session in rows and rows[session]["pinned"] and rows[session]["pin_expires_at"] is not None
    assert rows[session]["tokens"] == prefix
    # the unpinned traffic was evicted around the pin, and the store fits its budget (counted by the server and the
    # store, not by rows: how many rows a conversation leaves depends on how its prompt checkpoints dedupe)
    assert evicted > 0
    stats = json.loads(kvshelf_cli("stats", "--store", str(store), "--json").stdout)
    assert stats["stored_bytes"] <= 600 << 10

    with Server(model, store, tmp_path / "b.log", extra=extra) as server:  # within the TTL: the prefix is there
        hit = ask(server, [{"role": "user", "content": "what is the water"}], system=system)
        assert hit.usage.cache_read_input_tokens >= prefix and server.prefix_lines()[-1]["source"] == "disk"
        server.wait_log(r"kvshelf cache_control pinned tokens=\d+ ttl=300")  # re-pinned: the TTL restarts
        status, raw = server._request("GET", "/kvshelf/stats", None)  # the status page lists it with its expiry
        pins = {p["session_id"]: p for p in json.loads(raw)["pins"]}
        assert status == 200 and pins[session]["expires_at"] is not None
        status, page = server._request("GET", "/kvshelf", None)
        assert status == 200 and session in page.decode()
        server.signal(2)
        assert server.wait() == 0

    # an hour later (the store's clock moved by the test seam, no sleep): the pin lapsed, the budget evicts it
    later = {"KVSHELF_TEST_CLOCK_OFFSET": "3600"}
    with Server(model, store, tmp_path / "c.log", extra=extra, env=later) as server:
        _flood(server, range(40, 48))
        server.signal(2)
        assert server.wait() == 0
    assert session not in {r["session_id"] for r in _sessions(store)}


def _metric(server: Server, name: str) -> float:
    status, raw = server._request("GET", "/metrics", None)
    assert status == 200
    found = re.search(rf"^{re.escape(name)} (\S+)$", raw.decode(), re.M)  # a name or a whole series
    assert found, raw.decode()
    return float(found[1])


def _settled(server: Server) -> None:
    """Every write-behind of the server finished (its queue depth, read from /metrics)."""
    deadline = time.monotonic() + 120
    while _metric(server, "kvshelf_write_queue_depth") != 0:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)


def agent_trace(n_turns: int) -> list[list[dict]]:
    """``n_turns`` requests of one agent: each turn adds the previous step's tool call and its result (every
    fourth turn a plain user message instead); replies are fixed texts so both runs send the same prompts."""
    msgs: list[dict] = [{"role": "user", "content": "find the water and store the oil"}]
    turns = [list(msgs)]
    for k in range(1, n_turns):
        if k % 4 == 0:
            msgs += [{"role": "assistant", "content": words(12, salt=k)},
                     {"role": "user", "content": words(25, salt=k + 50)}]
        else:
            call = f"toolu_{k:02d}"
            msgs += [{"role": "assistant", "content": [
                         {"type": "text", "text": words(6, salt=k)},
                         {"type": "tool_use", "id": call, "name": TOOLS[k % 2]["name"],
                          "input": {"q" if k % 2 == 0 else "word": words(2, salt=k)}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                                   "content": words(20 + 15 * (k % 3), salt=k + 100)}]}]
        turns.append(list(msgs))
    return turns


def _replay(server: Server, turns: list[list[dict]]) -> list[tuple[int, int, str]]:
    out = []
    for msgs in turns:
        m = ask(server, msgs)
        out.append((prompt_of(m), m.usage.cache_read_input_tokens, text_of(m)))
    return out


def test_a_20_turn_agent_trace_hits_every_turn_and_a_short_restore_is_counted(model, tmp_path):
    turns = agent_trace(20)
    server = Server(model, tmp_path / "store", tmp_path / "first.log")
    try:
        fresh = _replay(server, turns)
        _settled(server)
        assert _metric(server, "kvshelf_ineffective_hits_total") == 0
    finally:
        server.kill()  # kill -9 after the writes settled: what survives is what the store made durable
    for k in range(1, len(turns)):  # the previous turn's prompt is this turn's prefix (the template appends)
        assert fresh[k][1] >= 0.95 * fresh[k - 1][0], (k, fresh[k], fresh[k - 1])

    with Server(model, tmp_path / "store", tmp_path / "restarted.log") as restarted:
        again = _replay(restarted, turns)
        assert [t for _p, _c, t in again] == [t for _p, _c, t in fresh]
        for k in range(1, len(turns)):
            assert again[k][1] >= 0.95 * again[k - 1][0], (k, again[k], again[k - 1])
        assert again[0][1] >= 0.95 * (again[0][0] - 1)  # turn 1 itself was stored before the kill
        assert restarted.prefix_lines()[0]["source"] == "disk"
        assert _metric(restarted, "kvshelf_ineffective_hits_total") == 0

    # a restore deliberately cut 40 tokens short (the test seam): served right, logged and counted once
    with Server(model, tmp_path / "store", tmp_path / "short.log",
                env={"KVSHELF_TEST_SHORT_RESTORE": "40"}) as short:
        got = ask(short, turns[5])
        assert text_of(got) == fresh[5][2]
        short.wait_log(r"kvshelf ineffective hit source=disk matched=\d+ held=\d+ .*fewer than the lookup matched")
        assert _metric(short, "kvshelf_ineffective_hits_total") == 1
        assert got.usage.cache_read_input_tokens <= fresh[5][0] - 40
        ask(short, turns[6])
        assert _metric(short, "kvshelf_ineffective_hits_total") == 1


def test_x_api_key_names_the_tenant_and_tenants_never_share(model, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("key-alice-0123456789 alice\nkey-bob-9876543210 bob\n")
    msgs = [{"role": "user", "content": "hello world"}]
    with Server(model, tmp_path / "store", tmp_path / "s.log", extra=("--api-keys", str(keys))) as server:
        def as_key(key: str) -> anthropic.types.Message:
            client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=key, max_retries=0,
                                         timeout=300)  # the SDK sends the key as x-api-key
            return client.messages.create(model="default_model", max_tokens=3, system=SYSTEM, messages=msgs,
                                          extra_body={"temperature": 0.0})

        with pytest.raises(anthropic.AuthenticationError):
            as_key("not-a-key")
        a1 = as_key("key-alice-0123456789")
        assert a1.usage.cache_read_input_tokens == 0
        assert as_key("key-alice-0123456789").usage.cache_read_input_tokens > 400  # alice's own prefix
        b = as_key("key-bob-9876543210")
        assert b.usage.cache_read_input_tokens == 0 and text_of(b) == text_of(a1)  # never alice's


def test_tool_calls_come_back_as_tool_use_blocks():
    """The parsed tool call (mlx-lm's json_tools parser, as a model with <tool_call> markers gets) as a block."""
    from mlx_lm.tool_parsers import json_tools

    from kvshelf.mlx_lm.serve.anthropic_messages import tool_use_blocks
    from kvshelf.mlx_lm.serve.anthropic_translate import translate

    t = translate({"max_tokens": 8, "tools": TOOLS, "messages": agent_turns([])})
    parsed = type("Ctx", (), {"tool_parser": staticmethod(json_tools.parse_tool_call)})
    blocks = tool_use_blocks(parsed, t.tools, ['{"name": "find", "arguments": {"q": "oil"}}'])
    assert len(blocks) == 1 and blocks[0]["type"] == "tool_use" and blocks[0]["id"].startswith("toolu_")
    assert blocks[0]["name"] == "find" and blocks[0]["input"] == {"q": "oil"}
    assert t.messages[1]["tool_calls"][0]["function"]["name"] == "find" and t.messages[2]["role"] == "tool"


def test_cache_control_on_a_tool_and_a_message_block(model, tmp_path):
    """A 1h breakpoint on a tool (the tools render with the system prompt) and a 5m one on the tool_result turn:
    each prefix pinned as its own session, the message's covering the conversation up to that block."""
    tools = [*TOOLS[:1], {**TOOLS[1], "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    msgs = agent_turns([])
    msgs[-1] = {"role": "user", "content": [{**msgs[-1]["content"][0], "cache_control": {"type": "ephemeral"}}]}
    msgs.append({"role": "user", "content": "and now the disk"})
    with Server(model, tmp_path / "store", tmp_path / "s.log") as server:
        m = claude(server).messages.create(model="default_model", max_tokens=3, system=SYSTEM, tools=tools,
                                           messages=msgs, extra_body={"temperature": 0.0})
        found = server.wait_log(r"kvshelf cache_control pinned tokens=(\d+) ttl=(\d+) session=(\S+)", count=2)
        by_ttl = {int(f[2]): (int(f[1]), f[3]) for f in found}
        assert set(by_ttl) == {300, 3600}
        system_end, message_end = by_ttl[3600][0], by_ttl[300][0]
        assert 400 < system_end < message_end < prompt_of(m)
        assert m.usage.cache_creation_input_tokens == message_end  # up to the last breakpoint
    rows = {r["session_id"]: r for r in _sessions(tmp_path / "store")}
    assert rows[by_ttl[3600][1]]["tokens"] == system_end and rows[by_ttl[300][1]]["tokens"] == message_end
    assert rows[by_ttl[3600][1]]["pinned"] and rows[by_ttl[300][1]]["pinned"]
