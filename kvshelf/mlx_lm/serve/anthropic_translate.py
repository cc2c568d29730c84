"""The Anthropic Messages body as the chat request mlx-lm templates (``POST /v1/messages``, ``anthropic_messages.py``).

Why its own file: the translation is the whole promise of the route — the same conversation reaches the same token
ids through either API — so it is a pure function of the body, testable without a server. System blocks become
one system message (texts joined by newlines), ``tool_use`` blocks an assistant message's ``tool_calls``, each
``tool_result`` a ``tool`` message, ``tools`` the chat template's tools (OpenAI's function shape), ``image`` blocks
image parts; earlier ``thinking`` blocks are dropped (templates strip earlier reasoning anyway). ``cache_control``
breakpoints are collected with where they sit (``cache_control.py`` turns them into segment ends and pins).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...errors import KvShelfError

ROUTE = "/v1/messages"


class MessagesRejected(KvShelfError):
    """A ``/v1/messages`` body this server cannot serve: answered 400 with Anthropic's error shape."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"POST {ROUTE}: {message}")


@dataclass
class Translated:
    """An Anthropic request as mlx-lm takes a chat request: messages, tools, stop words, sampling and the index of
    the last ``cache_control`` breakpoint (``breakpoints``: where in the OpenAI messages each one sits)."""

    messages: list[dict]
    tools: list[dict] | None
    stop: list[str]
    max_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    stream: bool
    model: str
    breakpoints: list[dict] = field(default_factory=list)  # {"where": "system"|"tools"|"message", "index", "ttl"}


def _text_of(blocks: Any, where: str) -> str:
    """A string, or the text of a list of text blocks (Anthropic allows both for system and tool results)."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise MessagesRejected(f"{where}: expected a string or a list of content blocks")
    parts = []
    for b in blocks:
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise MessagesRejected(f"{where}: only text blocks are supported here")
        parts.append(b["text"])
    return "\n".join(parts)


def _ttl_of(block: Any) -> str | None:
    cc = block.get("cache_control") if isinstance(block, dict) else None
    if cc is None:
        return None
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise MessagesRejected("cache_control: only {'type': 'ephemeral'} is supported")
    ttl = cc.get("ttl", "5m")
    if ttl not in ("5m", "1h"):
        raise MessagesRejected("cache_control.ttl must be '5m' or '1h'")
    return ttl


def _image_part(block: dict) -> dict:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        return {"type": "image_url", "image_url": {"url": f"data:{source.get('media_type')};base64,"
                                                          f"{source.get('data')}"}}
    if source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": source.get("url")}}
    raise MessagesRejected("image: source must be base64 or url")


def translate(body: Any) -> Translated:
    """The OpenAI-shaped request mlx-lm templates for an Anthropic Messages body; raises ``MessagesRejected``."""
    if not isinstance(body, dict):
        raise MessagesRejected("the body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise MessagesRejected("max_tokens is required: a positive integer")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise MessagesRejected("messages is required: a non-empty list")
    breakpoints: list[dict] = []
    messages: list[dict] = []

    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        messages.append({"role": "system", "content": text})
        if isinstance(system, list):
            for b in system:
                if (ttl := _ttl_of(b)) is not None:
                    breakpoints.append({"where": "system", "index": 0, "ttl": ttl})

    tools = None
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise MessagesRejected("tools must be a list")
        tools = []
        for t in body["tools"]:
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise MessagesRejected("tools: every tool needs a name")
            fn = {"name": t["name"], "description": t.get("description", ""),
                  "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
            tools.append({"type": "function", "function": fn})
            if (ttl := _ttl_of(t)) is not None:  # tools render before the system prompt's end in most templates
                breakpoints.append({"where": "tools", "index": 0, "ttl": ttl})

    for n, m in enumerate(raw_messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise MessagesRejected(f"messages[{n}]: role must be 'user' or 'assistant'")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise MessagesRejected(f"messages[{n}].content: a string or a list of blocks")
        texts: list[dict] = []
        tool_calls: list[dict] = []
        ttl_here = None
        for b in content:
            if not isinstance(b, dict):
                raise MessagesRejected(f"messages[{n}].content: every block is an object")
            ttl_here = _ttl_of(b) or ttl_here
            kind = b.get("type")
            if kind == "text":
                texts.append({"type": "text", "text": str(b.get("text", ""))})
            elif kind == "image" and role == "user":
                texts.append(_image_part(b))
            elif kind == "tool_use" and role == "assistant":
                tool_calls.append({"id": b.get("id"), "type": "function", "function": {
                    "name": b.get("name"), "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                messages.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                                 "content": _text_of(b.get("content"), f"messages[{n}] tool_result")})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning: templates strip it anyway, and it is not text the model re-reads
            else:
                raise MessagesRejected(f"messages[{n}]: a {kind!r} block is not supported in a {role} message")
        if texts or tool_calls or role == "assistant":
            out: dict[str, Any] = {"role": role}
            if all(p["type"] == "text" for p in texts):
                out["content"] = "".join(p["text"] for p in texts)
            else:
                out["content"] = texts
            if tool_calls:
                out["tool_calls"] = tool_calls
            messages.append(out)
        if ttl_here is not None:
            breakpoints.append({"where": "message", "index": len(messages) - 1, "ttl": ttl_here})

    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise MessagesRejected("stop_sequences must be a list of strings")
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
            raise MessagesRejected(f"{name} must be a non-negative number")
    top_k = body.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise MessagesRejected("top_k must be a non-negative integer")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise MessagesRejected("stream must be a boolean")
    return Translated(messages=messages, tools=tools or None, stop=list(stop), max_tokens=max_tokens,
                      temperature=body.get("temperature"), top_p=body.get("top_p"), top_k=top_k, stream=stream,
                      model=str(body.get("model", "default_model")), breakpoints=breakpoints)


__all__ = ["MessagesRejected", "ROUTE", "Translated", "translate"]
