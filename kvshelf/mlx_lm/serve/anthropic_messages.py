"""``POST /v1/messages``: the Anthropic Messages API on ``kvshelf serve``, for agents that speak it (Claude Code and
every client built on the ``anthropic`` SDK).

Why a translation and not a second server: the point of ``kvshelf serve`` is that one conversation reaches the same
token ids — and so the same cached prefix in RAM, on disk and in the shared tier — whichever client sent it. So the
Anthropic body is rewritten (``anthropic_translate.py``) into the OpenAI-shaped messages mlx-lm's own ``_tokenize`` templates (system blocks →
one system message, ``tool_use`` → an assistant message's ``tool_calls``, ``tool_result`` → a ``tool`` message,
``tools`` → the chat template's ``tools``), and handed to mlx-lm's generator exactly as mlx-lm's
``handle_completion`` does (a ``CompletionRequest`` and ``GenerationArguments``). Tokenizing, batching, the tiered
prompt cache, tenant scopes and the ``X-Kvshelf-Prefix`` header are therefore the OpenAI route's, unchanged; only
the reply is written in Anthropic's shape (a ``message`` object, or its SSE events).

``usage`` partitions the prompt as Anthropic's does (their sum is the prompt): ``cache_read_input_tokens`` are the
tokens served from any tier (the generation context's ``prompt_cache_count``), ``cache_creation_input_tokens`` the
rest of the prefix up to the last ``cache_control`` breakpoint (written and pinned, ``cache_control.py``), and
``input_tokens`` what follows.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from ..upstream import completion_headers, stream_headers
from .anthropic_translate import MessagesRejected, Translated, translate

log = logging.getLogger("kvshelf.serve")

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def generation_arguments(t: Translated, cli: Any) -> Any:
    """mlx-lm's ``GenerationArguments`` for ``t``, defaults from the server's command line as ``handle_completion``
    takes them (so an unset temperature is the server's ``--temp``, as on the OpenAI route)."""
    from mlx_lm import server as mlx

    return mlx.GenerationArguments(
        model=mlx.ModelDescription(model=t.model, draft="default_model", adapter=None),
        sampling=mlx.SamplingArguments(
            temperature=cli.temp if t.temperature is None else float(t.temperature),
            top_p=cli.top_p if t.top_p is None else float(t.top_p),
            top_k=cli.top_k if t.top_k is None else t.top_k, min_p=cli.min_p,
            xtc_probability=0.0, xtc_threshold=0.1),
        logits=mlx.LogitsProcessorArguments(
            logit_bias=None, repetition_penalty=0.0, repetition_context_size=20, presence_penalty=0.0,
            presence_context_size=20, frequency_penalty=0.0, frequency_context_size=20),
        stop_words=t.stop, max_tokens=t.max_tokens, num_draft_tokens=cli.num_draft_tokens, logprobs=False,
        top_logprobs=-1, seed=None, chat_template_kwargs=None)


def completion_request(t: Translated) -> Any:
    from mlx_lm import server as mlx

    return mlx.CompletionRequest("chat", "", t.messages, t.tools, None)


def tool_use_blocks(ctx: Any, tools: list[dict] | None, tool_texts: list[str]) -> list[dict]:
    """mlx-lm's tool parser over the tool-call texts the model wrote, as Anthropic ``tool_use`` blocks."""
    from mlx_lm.server import ToolCallFormatter

    blocks = []
    for call in ToolCallFormatter(ctx.tool_parser, tools)(tool_texts):
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = {}
        blocks.append({"type": "tool_use", "id": "toolu_" + str(call["id"]).replace("-", "")[:24],
                       "name": fn["name"], "input": args if isinstance(args, dict) else {"value": args}})
    return blocks


def usage(prompt: int, cached: int, creation_end: int, output: int) -> dict:
    """Anthropic's usage: read + created + plain input = the prompt (``creation_end``: where the last breakpoint's
    prefix ends, 0 without one)."""
    cached = max(cached, 0)
    creation = max(min(creation_end, prompt) - cached, 0)
    return {"input_tokens": prompt - cached - creation, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": creation, "output_tokens": output}


class MessagesRoute:
    """Serves one ``/v1/messages`` request on an mlx-lm handler (``handler``): its generator, its wfile, its
    header helpers. ``breakpoints`` is the ``cache_control`` side (``cache_control.CacheBreakpoints``) or None."""

    def __init__(self, handler: Any, breakpoints: Any = None):
        self.h = handler
        self.breakpoints = breakpoints

    def error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        body = json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
        completion_headers(self.h, status)
        self.h.send_header("Content-Length", str(len(body)))
        self.h.end_headers()
        self.h.wfile.write(body)
        self.h.wfile.flush()

    def serve(self, t: Translated) -> None:
        from mlx_lm.server import TextStateMachine

        h = self.h
        h.stream = t.stream
        h.requested_model = t.model
        request = completion_request(t)
        args = generation_arguments(t, h.response_generator.cli_args)
        if self.breakpoints is not None and t.breakpoints:
            self.breakpoints.announce(request, t)  # the prefix lengths are known once the generator tokenized

        msg_id = "msg_" + uuid.uuid4().hex[:24]
        stream = _Stream(h, msg_id, t.model) if t.stream else None
        held: list[Any] = []  # the generation context, once generate() returned it

        def keepalive(processed, total):  # called while prefilling, after the fetch: the usage is known
            logging.info(f"Prompt processing progress: {processed}/{total}")
            if stream is not None and held:
                stream.start(self._usage(held[0], request, 0))  # message_start first, then pings
                stream.ping()

        try:
            ctx, response = h.response_generator.generate(request, args, progress_callback=keepalive)
        except Exception as exc:  # noqa: BLE001 - mlx-lm's own errors (a template, the model) as its route answers
            self.error(400, str(exc))
            return
        held.append(ctx)
        if t.stream:
            stream_headers(h, 200)
            h.end_headers()
        else:
            completion_headers(h, 200)
        sm_state = ctx.text_sm.make_state(ctx.initial_state)
        prev_state = ctx.initial_state
        finish_reason = "stop"
        text, tool_text, tool_texts, n_tokens = "", "", [], 0
        try:
            for gen in response:
                if stream is not None:
                    stream.start(self._usage(ctx, request, 0))
                if gen.finish_reason == "stop":
                    sm_state, current = TextStateMachine.discard(sm_state)
                    segments = [(current, "")]
                elif gen.finish_reason == "length":
                    sm_state, segments = TextStateMachine.split(sm_state, gen.text)
                    sm_state, flushed, current = TextStateMachine.flush(sm_state)
                    segments.append((current, flushed))
                else:
                    sm_state, segments = TextStateMachine.split(sm_state, gen.text)
                for current, clean in segments:
                    if current == "tool":
                        tool_text += clean
                    elif current == "normal":
                        if prev_state == "tool":
                            tool_texts.append(tool_text)
                            tool_text = ""
                            if stream is not None:
                                stream.tools(tool_use_blocks(ctx, t.tools, tool_texts[-1:]))
                        text += clean
                        if stream is not None and clean:
                            stream.text(clean)
                    prev_state = current
                n_tokens += 1
                if gen.finish_reason is not None:
                    finish_reason = gen.finish_reason
            if prev_state == "tool" and tool_text:
                tool_texts.append(tool_text)
                if stream is not None:
                    stream.tools(tool_use_blocks(ctx, t.tools, tool_texts[-1:]))
            if finish_reason == "stop" and tool_texts:
                finish_reason = "tool_calls"
            stop_reason = STOP_REASONS.get(finish_reason, "end_turn")
            stop_sequence = next((s for s in t.stop if text.endswith(s)), None) if stop_reason == "end_turn" else None
            if stop_sequence is not None:
                stop_reason = "stop_sequence"
            if self.breakpoints is not None and t.breakpoints:
                self.breakpoints.served(request, ctx, h.response_generator.model_provider.model_key)
            use = self._usage(ctx, request, n_tokens)
            if stream is not None:
                stream.start(self._usage(ctx, request, 0))
                stream.finish(stop_reason, stop_sequence, use)
                return
            content = ([{"type": "text", "text": text}] if text or not tool_texts else []) + tool_use_blocks(
                ctx, t.tools, tool_texts)
            body = json.dumps({"id": msg_id, "type": "message", "role": "assistant", "model": t.model,
                               "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                               "usage": use}).encode()
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            h.wfile.flush()
        finally:
            ctx.stop()

    def _usage(self, ctx: Any, request: Any, output: int) -> dict:
        end = self.breakpoints.prefix_end(request) if self.breakpoints is not None else 0
        return usage(len(ctx.prompt), ctx.prompt_cache_count, end, output)


class _Stream:
    """Anthropic's SSE events for one message: message_start, a text block's start/deltas/stop, one block per
    tool call (its input as one input_json_delta), message_delta with the stop reason and usage, message_stop."""

    def __init__(self, handler: Any, msg_id: str, model: str):
        self.h, self.msg_id, self.model = handler, msg_id, model
        self.index = 0
        self.open_text = False
        self.started = False

    def _event(self, name: str, data: dict) -> None:
        self.h.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        self.h.wfile.flush()

    def start(self, use: dict) -> None:
        """message_start, once (the first token, a prefill progress report or the end, whichever comes first)."""
        if self.started:
            return
        self.started = True
        self._event("message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": use}})

    def ping(self) -> None:
        self._event("ping", {"type": "ping"})

    def text(self, piece: str) -> None:
        if not self.open_text:
            self._event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                "content_block": {"type": "text", "text": ""}})
            self.open_text = True
        self._event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                            "delta": {"type": "text_delta", "text": piece}})

    def _close_text(self) -> None:
        if self.open_text:
            self._event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.index += 1
            self.open_text = False

    def tools(self, blocks: list[dict]) -> None:
        self._close_text()
        for b in blocks:
            self._event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                "content_block": {**b, "input": {}}})
            self._event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}})
            self._event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.index += 1

    def finish(self, stop_reason: str, stop_sequence: str | None, use: dict) -> None:
        self._close_text()
        self._event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": use})
        self._event("message_stop", {"type": "message_stop"})


def read_body(handler: Any) -> Any:
    """The JSON body of a ``/v1/messages`` POST (``MessagesRejected`` when it is missing or not JSON)."""
    length = handler.headers.get("Content-Length")
    try:
        raw = handler.rfile.read(int(length)) if length is not None else b""
        return json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        raise MessagesRejected("the body must be JSON with a Content-Length") from None


def serve_messages(handler: Any, serving: Any, with_body: Any) -> None:
    """The route: parse, translate, narrow the request context by the body (``with_body``: ``cache_salt``), serve.
    The caller (``http_routes``) has authenticated the request already."""
    started = time.monotonic()
    route = MessagesRoute(handler, getattr(serving, "breakpoints", None))
    try:
        body = read_body(handler)
        handler.body = body
        with_body(body)
        t = translate(body)
    except MessagesRejected as exc:
        handler.close_connection = True
        route.error(400, exc.message)
        return
    route.serve(t)
    log.debug("kvshelf messages served in %.3fs", time.monotonic() - started)


__all__ = ["MessagesRoute", "generation_arguments", "serve_messages", "tool_use_blocks", "usage"]
