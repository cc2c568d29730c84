"""Checkpoints: a session's state at token counts ``k1 < k2 < …`` beside its snapshot, for caches that cannot be cut.

Why: a recurrent state (mlx-lm's ``ArraysCache``: Mamba, Qwen3-Next's linear attention) or a wrapped sliding-window
ring (``RotatingKVCache``) cannot be cut back to a shorter prefix, so a snapshot of such caches is usable only at
its exact length. A prompt that shares 3,000 tokens with a stored 4,000-token session but differs after that got
nothing. A checkpoint at ``k`` is the whole cache state after ``tokens[:k]``; the prefix search then serves any
prompt that matches those ``k`` tokens (``k <= len(prompt) - 1``) from it.

How (the store as it is, nothing new in the index): a checkpoint is an ordinary snapshot of ``tokens[:k]`` saved
under a *derived session id* in its session's namespace: ``<session id> NUL "ckpt:" <k, 12 digits>``. Clients can
never name such a session (session ids refuse NUL: ``inputs.py``), and the derived ids of one session are exactly
the ``sessions`` keys that start with the session's key + ``NUL ckpt:`` (a range scan, in ``k`` order). So:

* the prefix search finds a checkpoint like any snapshot of exact length ``k`` (its own prefix records, its floor,
  its trimmability), and ``lookup`` reports the parent session with ``PrefixHit.checkpoint = True``;
* chunks are content-addressed, so a checkpoint's attention chunks are the session's own (same content, same hash:
  the chunk windows of ``tokens[:k]`` are the session's when ``chunk_tokens`` divides ``k``) and only the uncuttable
  state's chunks are new bytes. They count in the budget like every chunk and ``verify``/``gc``/``rebuild_index``
  see ordinary snapshots;
* a checkpoint never outlives its session: every removal of a session's snapshot (delete, eviction, quarantine: the
  ``liveness/removal.py``, whose follower this is) drops its checkpoints in the same write transaction (``forget``), ``rebuild_index``
  drops the checkpoints whose session it did not bring back (``orphans``), and a checkpoint is only saved for a
  session that exists. A checkpoint alone may be evicted (least recently used) before its session: that only
  loses reuse.
* ``sessions()`` and the tools' listings do not show checkpoints as sessions (``is_checkpoint``); ``of`` lists a
  session's checkpoints.

``Checkpoints`` receives what it needs in its constructor: the index (a callable: ``rebuild_index`` replaces it), the
façade's session-key function and the
save call it uses for a derived session (capture → one pack → one commit, as every save).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import InvalidCacheState, SnapshotNotFound
from ..index import keys
from ..index import tables
from ..index.keys import CHECKPOINT_MARK, checkpoint_id, is_checkpoint
from ..liveness import ledger
from ..index import schema
from ..prefix.hashing import tokens_array

_MARK_BYTES = CHECKPOINT_MARK.encode()


class CheckpointInfo(NamedTuple):
    """One stored checkpoint: its length, snapshot id, and the bytes its snapshot references (shared ones too)."""

    length: int
    snapshot_id: str
    nbytes: int
    created_at: float


class Checkpoints:
    """Saving, listing and dropping a session's checkpoints (module docstring). ``session_key(session_id,
    namespace)`` is the façade's key function; ``save(session_id, tokens, caches, namespace)`` saves one snapshot."""

    def __init__(self, index: Callable[[], Any], session_key: Callable[[str, str], bytes],
                 save: Callable[[str, np.ndarray, Sequence[Any], str], Any],
                 capture: Callable[[str, np.ndarray, Sequence[Any], str], Any] | None = None,
                 write: Callable[[Any], Any] | None = None):
        self._index, self.session_key, self._save = index, session_key, save
        self._capture, self._write = capture, write  # save_async: captured now, written in the background

    # --- saving ---------------------------------------------------------------------------------------------------
    def save(self, session_id: str, tokens: Sequence[int], caches: Sequence[Any], namespace: str = "") -> Any:
        """Save ``caches`` (the state after ``tokens``, all of them) as the checkpoint of ``session_id`` at
        ``len(tokens)``. The session must exist (a checkpoint never outlives — or precedes — its session)."""
        toks = tokens_array(tokens)
        if len(toks) < 1:
            raise InvalidCacheState("a checkpoint needs at least one token")
        skey = self.session_key(session_id, namespace)
        with self._index().read() as txn:
            if txn.get("sessions", skey) is None:
                raise SnapshotNotFound(f"no session {session_id!r} in namespace {namespace!r} to checkpoint: "
                                       f"save the session first")
        return self._save(checkpoint_id(session_id, len(toks)), toks, caches, namespace)

    def save_many(self, session_id: str, tokens: np.ndarray, checkpoints: Mapping[int, Sequence[Any]],
                  namespace: str) -> list[Any]:
        """``store.save(..., checkpoints={k: caches_at_k})``: each ``0 < k < len(tokens)``, saved in ``k`` order
        after the session itself (so the session's chunks are already there to share)."""
        return [self.save(session_id, tokens[:int(k)], checkpoints[k], namespace) for k in self.ordered(tokens,
                                                                                                 checkpoints)]

    @staticmethod
    def ordered(tokens: np.ndarray, checkpoints: Mapping[int, Sequence[Any]]) -> list:
        """The checkpoints' token counts in order, each checked (before anything is written)."""
        if not isinstance(checkpoints, Mapping):
            raise InvalidCacheState(f"checkpoints must be a mapping {{k: caches_at_k}}, got "
                                    f"{type(checkpoints).__name__}")
        for k in checkpoints:
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 < int(k) < len(tokens):
                raise InvalidCacheState(f"checkpoint token count {k!r} must be an int with 0 < k < {len(tokens)} "
                                        f"(the session's length)")
        return sorted(checkpoints)

    def capture_many(self, session_id: str, tokens: np.ndarray, checkpoints: Mapping[int, Sequence[Any]],
                     namespace: str) -> list[Any]:
        """``save_async``'s half in the caller's thread: every checkpoint snapshotted and evaluated now."""
        return [self._capture(checkpoint_id(session_id, int(k)), tokens[:int(k)], checkpoints[k], namespace)
                for k in self.ordered(tokens, checkpoints)]

    def write_captured(self, session_id: str, namespace: str, captures: Sequence[Any]) -> list[Any]:
        """The background half, after the session's own write (so the session exists to own them)."""
        skey = self.session_key(session_id, namespace)
        out = []
        for cap in captures:
            with self._index().read() as txn:
                if txn.get("sessions", skey) is None:  # removed meanwhile: its checkpoints would be orphans
                    return out
            try:
                out.append(self._write(cap))
            except SnapshotNotFound:  # removed while this one was written (``owner_gone``): nothing was kept
                return out
        return out

    # --- listing --------------------------------------------------------------------------------------------------
    def of(self, txn, skey: bytes) -> list[tuple[bytes, bytes]]:
        """(derived session key, snapshot id) of every checkpoint of the session keyed ``skey``, in ``k`` order."""
        start = skey + _MARK_BYTES
        return [(bytes(key), bytes(sid)) for key, sid in txn.range("sessions", start, keys.after_prefix(start))]

    def listed(self, session_id: str, namespace: str = "") -> list[CheckpointInfo]:
        skey = self.session_key(session_id, namespace)
        out = []
        with self._index().read() as txn:
            for _key, sid in self.of(txn, skey):
                raw = txn.get("summaries", sid)
                if raw is None:
                    continue
                s = schema.decode(raw, schema.Summary, f"summary {sid.hex()}")
                out.append(CheckpointInfo(s.length, sid.hex(), s.nbytes, s.created_at))
        return out

    # --- removal --------------------------------------------------------------------------------------------------
    def forget(self, txn, summary: schema.Summary) -> list[str]:
        """``Removal``'s follower: a session's checkpoints go with its snapshot; returns the objects they freed."""
        return self.drop_along(txn, summary, lambda sid: ledger.drop(self._index(), txn, sid))

    def drop_along(self, txn, summary: schema.Summary, drop: Callable[[bytes], list[str]]) -> list[str]:
        """In the write transaction removing ``summary``'s snapshot: when it is its session's current snapshot (not
        a checkpoint, not an older one), drop every checkpoint of the session with ``drop(sid)`` (``ledger.drop``);
        returns the objects they freed."""
        if is_checkpoint(summary.session_id):
            return []
        skey = keys.summary_session_key(summary)
        if txn.get("sessions", skey) is not None:  # not the session's last snapshot going: the session stays
            return []
        freed: list[str] = []
        for _key, sid in self.of(txn, skey):
            freed += drop(sid)
        return freed

    @staticmethod
    def drop_quarantined(txn, skey: bytes) -> int:
        """``delete`` of a session also drops the quarantine records of its checkpoints (the operator's "drop
        it" covers the session's checkpoints too)."""
        start = skey + _MARK_BYTES
        found = [bytes(key) for key, _ in txn.range("quarantine", start, keys.after_prefix(start))]
        for key in found:
            txn.delete("quarantine", key)
        return len(found)

    @classmethod
    def owner_gone(cls, txn, manifest: schema.Manifest) -> bool:
        """Whether ``manifest`` is a checkpoint whose session is not indexed, read in the transaction that would
        commit it: the check before the save cannot see a delete (or eviction) that commits while the checkpoint's
        pack is written, and a checkpoint committed after its session went would be an orphan no removal follows."""
        return is_checkpoint(manifest.session_id) and tables.orphan_checkpoint(txn, keys.manifest_keys(manifest)[2])


__all__ = ["CheckpointInfo", "Checkpoints"]
