"""Generation checkpoints: what a server was *generating* when it died, so that the retried request resumes.

Why a room of its own on the store's public API: a checkpoint is an ordinary snapshot (prompt + tokens generated so
far, and the caches covering them) plus three facts the decode loop needs to continue exactly — the prompt length,
the *pending* token (sampled from that state, not yet emitted) and the sampler's random state. Built on ``save`` /
``sessions`` / ``manifest`` / ``restore_snapshot`` / ``delete`` only, checkpoints share chunks with every other
snapshot, count in the budget, and are verified, quarantined and collected exactly like sessions.

Layout: the checkpoints of a continuation key live in the namespace ``__generation_checkpoint__:<key>`` (never seen
by an ordinary ``lookup``, which is per namespace); each checkpoint is one session whose id carries the three facts
(``g<generated>-p<prompt length>-t<pending>-s<state hex>-<nonce>``), the manifest's tokens carry the rest.

Durability: a checkpoint is one store save (pack fsynced and renamed, then one index commit), so a crash mid-write
leaves at most an orphan pack (``gc``) and the previous checkpoint of the key still indexed. Older checkpoints of the
key are deleted only after the newer one is durable (a crash in between leaves two; ``find`` takes the longest).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ...errors import CorruptData, InvalidCacheState, SnapshotNotFound, WrongArgumentType
from .. import inputs
from ..identity import tenant_namespace

NAMESPACE_PREFIX = "__generation_checkpoint__:"
KEY_VERSION = 1
MAX_SAMPLER_STATE_BYTES = 64
_KEY = re.compile(r"[0-9A-Za-z_.-]{1,128}")
_SID = re.compile(r"g(?P<generated>\d+)-p(?P<prompt>\d+)-t(?P<pending>\d+)-s(?P<state>[0-9a-f]*|-)-[0-9a-f]+")


def continuation_key(fields: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``fields``: object keys sorted at every depth, arrays in order, no
    whitespace, NaN refused. A pure function of what determines a generation's continuation; callers pass every
    field that does (model identity, prompt ids, sampling and penalty settings, stop sequences, max tokens, ...)."""
    try:
        text = json.dumps({"kvshelf_continuation": KEY_VERSION, **fields}, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidCacheState(f"continuation key fields must be plain JSON values: {exc}") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class GenerationCheckpoint:
    """A restored checkpoint: ``caches`` cover ``tokens`` (prompt + generated); ``pending_token`` was sampled from
    that state and not yet emitted; ``sampler_state`` is the random state right after that sampling."""

    key: str
    snapshot_id: str
    tokens: list[int]
    caches: list[Any]
    prompt_length: int
    pending_token: int
    sampler_state: bytes | None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length:]


@dataclass(frozen=True)
class _Entry:
    session_id: str
    snapshot_id: str
    generated: int
    prompt_length: int
    pending_token: int
    sampler_state: bytes | None


def _check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise WrongArgumentType(f"a generation checkpoint key must be a str, got {type(key).__name__}")
    if not _KEY.fullmatch(key):
        raise InvalidCacheState(f"a generation checkpoint key is 1-128 characters of [0-9A-Za-z_.-], got {key!r}")
    return key


def _parse(session_id: str, snapshot_id: str) -> _Entry | None:
    m = _SID.fullmatch(session_id)
    if m is None:
        return None
    state = None if m["state"] == "-" else bytes.fromhex(m["state"])
    return _Entry(session_id, snapshot_id, int(m["generated"]), int(m["prompt"]), int(m["pending"]), state)


class GenerationCheckpoints:
    """The checkpoints of every continuation key in one store (stateless; built once per handle by the façade).

    ``store`` is used through its public calls only: ``save`` / ``save_async``, ``sessions``, ``admin.manifest``,
    ``restore_snapshot``, ``delete``.
    """

    def __init__(self, store: Any):
        self.store = store

    @staticmethod
    def namespace(key: str, tenant: str = "") -> str:
        """The key's namespace, in ``tenant``'s scope: a tenant's checkpoints are its own and go with it."""
        return tenant_namespace(NAMESPACE_PREFIX + _check_key(key), tenant)

    # ------------------------------------------------------------------ save
    def save(self, key: str, tokens: Sequence[int], caches: Sequence[Any], *, prompt_length: int,
             pending_token: int, sampler_state: bytes | None, background: bool = False, tenant: str = ""):
        """Write a checkpoint of ``key`` (SnapshotInfo), then delete the key's shorter checkpoints. With
        ``background=True`` the caches are captured now and written behind: a Future that resolves once the
        checkpoint is durable and the older ones are gone (errors are the Future's)."""
        ns = self.namespace(key, tenant)
        tokens = inputs.check_tokens(tokens)
        n = len(tokens)
        if not isinstance(prompt_length, int) or isinstance(prompt_length, bool) or not 1 <= prompt_length < n:
            raise InvalidCacheState(f"prompt_length must be an int in [1, {n}) (a checkpoint holds at least one "
                                    f"generated token), got {prompt_length!r}")
        if (not isinstance(pending_token, int) or isinstance(pending_token, bool)
                or not 0 <= pending_token < 2 ** 31):
            raise InvalidCacheState(f"pending_token must be a token id in [0, 2**31), got {pending_token!r}")
        if sampler_state is not None:
            if not isinstance(sampler_state, (bytes, bytearray)):
                raise WrongArgumentType(f"sampler_state must be bytes or None, got {type(sampler_state).__name__}")
            if len(sampler_state) > MAX_SAMPLER_STATE_BYTES:
                raise InvalidCacheState(f"sampler_state holds at most {MAX_SAMPLER_STATE_BYTES} bytes, "
                                        f"got {len(sampler_state)}")
        generated = n - prompt_length
        state = "-" if sampler_state is None else bytes(sampler_state).hex()
        sid = f"g{generated:010d}-p{prompt_length}-t{pending_token}-s{state}-{uuid.uuid4().hex[:12]}"
        if not background:
            info = self.store.save(sid, tokens, caches, namespace=ns)
            self._drop_older(ns, sid, generated)
            return info
        done: Future = Future()
        inner = self.store.save_async(sid, tokens, caches, namespace=ns)

        def durable(fut: Future) -> None:
            exc = fut.exception()
            if exc is not None:
                done.set_exception(exc)
                return
            try:
                self._drop_older(ns, sid, generated)
            except Exception as drop_exc:  # noqa: BLE001 - the new checkpoint is durable; report the cleanup
                done.set_exception(drop_exc)
                return
            done.set_result(fut.result())

        inner.add_done_callback(durable)
        return done

    def _drop_older(self, ns: str, keep: str, generated: int) -> None:
        """Delete the key's checkpoints shorter than the one just made durable (a longer one — another process
        further along the same continuation — is kept)."""
        for entry in self._entries(ns):
            if entry.session_id != keep and entry.generated <= generated:
                try:
                    self.store.delete(entry.session_id, ns)
                except SnapshotNotFound:
                    pass

    # ------------------------------------------------------------------ find
    def _entries(self, ns: str) -> list[_Entry]:
        out = []
        for s in self.store.sessions(ns):
            entry = _parse(s.session_id, s.snapshot_id)
            if entry is not None:
                out.append(entry)
        return out

    def find(self, key: str, prompt_tokens: Sequence[int], tenant: str = "") -> GenerationCheckpoint | None:
        """The longest checkpoint of ``key`` made for exactly this prompt (its prompt length is the prompt's and its
        tokens start with it), restored; None when there is none. A checkpoint that fails verification is
        quarantined by the store and the next longest is tried."""
        ns = self.namespace(key, tenant)
        prompt = [int(t) for t in inputs.check_tokens(prompt_tokens)]
        entries = sorted((e for e in self._entries(ns) if e.prompt_length == len(prompt)),
                         key=lambda e: -e.generated)
        for e in entries:
            try:
                manifest = self.store.admin.manifest(e.snapshot_id)
                tokens = list(manifest.tokens)
                if len(tokens) != e.prompt_length + e.generated or tokens[:len(prompt)] != prompt:
                    continue
                restored = self.store.restore_snapshot(e.snapshot_id)
            except (SnapshotNotFound, CorruptData):  # replaced meanwhile, or damaged (now quarantined)
                continue
            return GenerationCheckpoint(key, e.snapshot_id, list(restored.tokens), list(restored.caches),
                                        e.prompt_length, e.pending_token, e.sampler_state)
        return None

    # ------------------------------------------------------------------ drop
    def drop(self, key: str, tenant: str = "") -> int:
        """Delete every checkpoint of ``key`` (the generation completed); how many were deleted."""
        ns = self.namespace(key, tenant)
        count = 0
        for s in self.store.sessions(ns):
            try:
                self.store.delete(s.session_id, ns)
                count += 1
            except SnapshotNotFound:
                pass
        return count


__all__ = ["GenerationCheckpoint", "GenerationCheckpoints", "NAMESPACE_PREFIX", "continuation_key"]
