"""Warm-up: prefill the prompts that matter into the store before the first request needs them.

Why: the first request after a start is the slowest one a user sees (a cold prefill of a long system prompt). A
warm-prompts file names those prompts as JSON Lines, one request per line: ``{"messages": [...]}`` (a chat request,
templated exactly as the server templates it: mlx-lm's message content handling, the tokenizer's chat template with
the generation prompt and ``--chat-template-args``) or ``{"prompt": "..."}`` (a completion, tokenized as is).

For each prompt of ``n`` tokens the store is asked first: a usable stored prefix of ``n - 1`` tokens (what any
request can take at most: the server recomputes the last token) means it is already warm (``from_store``).
Otherwise its first ``n - 1`` tokens are prefilled and saved, under the session id the server's own write-behind
uses for those tokens (``session_id_for``), so the server and warm-up never store the same tokens twice. Saving the
``n - 1`` prefix keeps recurrent and rotating layers exact where a request takes them. With ``pin`` each warmed
prompt's session is pinned (``Store.pin``): the budget never evicts it. ``kvshelf serve --warm-prompts`` runs this
before the server listens, ``kvshelf warm`` offline; both log ``kvshelf warm done prompts=N prefilled=M
from_store=K``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import KvShelfError, SnapshotNotFound
from .prompt_cache import session_id_for

log = logging.getLogger("kvshelf.serve")


class WarmPromptsError(KvShelfError, ValueError):
    """A warm-prompts file that cannot be read or has a line that is not a chat or completion request."""


@dataclass
class WarmReport:
    prompts: int = 0
    prefilled: int = 0
    from_store: int = 0
    pinned: int = 0
    refused_pins: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"kvshelf warm done prompts={self.prompts} prefilled={self.prefilled} from_store={self.from_store}"


def read_warm_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The requests of a JSON Lines file (blank lines and ``#`` comments skipped); a bad line names itself."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WarmPromptsError(f"warm prompts {p}: cannot read it: {exc}") from None
    items = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise WarmPromptsError(f"warm prompts {p} line {no}: not JSON: {exc}") from None
        ok = isinstance(item, dict) and (
            (isinstance(item.get("messages"), list) and item["messages"]
             and all(isinstance(m, dict) and "role" in m for m in item["messages"]))
            or isinstance(item.get("prompt"), str))
        if not ok:
            raise WarmPromptsError(f'warm prompts {p} line {no}: expected {{"messages": [...]}} (a chat request) '
                                   f'or {{"prompt": "..."}}')
        items.append(item)
    return items


def template(tokenizer: Any, item: dict[str, Any], chat_template_args: dict[str, Any] | None = None) -> list[int]:
    """The prompt tokens the server computes for this request (mlx-lm 0.32's ``_tokenize``, text only)."""
    if "messages" not in item:
        return list(tokenizer.encode(item["prompt"]))
    from mlx_lm.server import convert_chat, process_message_content

    messages = json.loads(json.dumps(item["messages"]))  # the server works on its own copy too
    if not tokenizer.has_chat_template:
        return list(tokenizer.encode(convert_chat(messages, item.get("role_mapping"))))
    process_message_content(messages, keep_images=False)
    args = dict(chat_template_args or {})
    args.update(item.get("chat_template_kwargs") or {})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=item.get("tools"),
                                              tokenize=True, **args))


def prefill(model: Any, tokens: list[int], step: int = 2048) -> list[Any]:
    """mlx-lm's prompt caches for ``model`` holding ``tokens`` (prefilled in steps, evaluated)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for i in range(0, len(tokens), max(1, step)):
        model(mx.array(tokens[i:i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def warm(model: Any, tokenizer: Any, store: Any, items: list[dict[str, Any]], *, namespace: str = "",
         pin: bool = False, pin_ttl: float | None = None, chat_template_args: dict[str, Any] | None = None,
         prefill_step: int = 2048, ledger: Any = None) -> WarmReport:
    """Prefill what the store does not hold yet; pin every warmed prompt with ``pin``. A pin the store refuses
    (over ``max_pinned_bytes``) is logged and listed in ``refused_pins``; the prompt stays warm, unpinned.

    What is pinned is the warm prompt's own session (``session_id_for`` its prefix), never the session the store's
    lookup found it in: that may be a user's conversation that starts with the warm prompt. When the prompt is
    held only inside another session, its prefix is restored from there and saved under its own session (chunks
    are shared: no new chunk, no prefill). ``ledger`` (``warm_pins.WarmPinLedger``): a session pinned by an
    earlier run and no longer pinned was unpinned by an operator and is not pinned again."""
    report = WarmReport()
    pinned_now = {(p.namespace, p.session_id) for p in store.pins.listing()} if pin and ledger is not None else set()
    for item in items:
        tokens = template(tokenizer, item, chat_template_args)
        report.prompts += 1
        if len(tokens) < 2:
            continue
        want = len(tokens) - 1
        prefix = tokens[:want]
        session = session_id_for(prefix)
        hit = store.lookup(tokens, namespace)
        tier = getattr(store, "tier", None)
        local = hit is not None and not (tier is not None and tier.knows(hit.snapshot_id))
        if hit is not None and hit.length >= want and (local or not pin):
            report.from_store += 1
            if not pin:
                session = hit.session_id
        else:
            store.save(session, prefix, prefill(model, prefix, prefill_step), namespace=namespace)
            report.prefilled += 1
        report.sessions.append(session)
        if pin:
            if ledger is not None and ledger.pinned_before(namespace, session) \
                    and (namespace, session) not in pinned_now:
                log.info("kvshelf warm: %s was unpinned since --pin-warm pinned it; not pinned again", session)
                continue
            try:
                try:
                    store.pin(session, namespace, ttl=pin_ttl)
                except SnapshotNotFound:  # held only inside another session (a conversation): give it its own
                    _own_session(store, hit, session, prefix, namespace, model, prefill_step)
                    store.pin(session, namespace, ttl=pin_ttl)
                report.pinned += 1
                if ledger is not None:
                    ledger.record(namespace, session)
            except KvShelfError as exc:
                report.refused_pins.append(session)
                log.warning("kvshelf warm: pin of %s refused: %s", session, exc)
    log.info(report.line())
    return report


def _own_session(store: Any, hit: Any, session: str, prefix: list[int], namespace: str, model: Any,
                 prefill_step: int) -> None:
    """Save the warm prompt under a session of its own: a restored cut of the snapshot that holds it (its chunks
    are the same), or a prefill when the store cannot hand it back."""
    try:
        caches = store.restore_snapshot(hit.snapshot_id, len(prefix)).caches
    except KvShelfError:
        caches = prefill(model, prefix, prefill_step)
    store.save(session, prefix, caches, namespace=namespace)


__all__ = ["WarmPromptsError", "WarmReport", "prefill", "read_warm_prompts", "template", "warm"]
