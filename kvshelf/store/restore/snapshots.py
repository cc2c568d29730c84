"""Finding a snapshot's manifest: by id, or as a session's latest for this handle's identity — and saying why not.

Why apart from the read engine: every restore call, the offline tools, the shared tier and the save path's
publishing ask "which manifest is this?", and the answer carries the store's refusals (another identity's snapshot,
a quarantined session, a damaged pointer), which must be the same wherever it is asked.
"""

from __future__ import annotations

import msgspec

from ...errors import CorruptData, IdentityMismatch, InvalidCacheState, SnapshotNotFound
from .. import inputs
from ..context import StoreContext
from ..identity import namespace_key
from ..index import keys, tables
from ..index import schema
from ..index.schema import Manifest
from ..results import SessionInfo


def sid_bytes(snapshot_id: str) -> bytes:
    try:
        sid = bytes.fromhex(snapshot_id)
    except (TypeError, ValueError):
        raise InvalidCacheState(f"snapshot id must be 32 hex digits, got {snapshot_id!r}") from None
    if len(sid) != 16:
        raise InvalidCacheState(f"snapshot id must be 32 hex digits, got {snapshot_id!r}")
    return sid


class Snapshots:
    def __init__(self, ctx: StoreContext):
        self.ctx = ctx

    def session_key(self, session_id: str, namespace: str) -> bytes:
        """The ``sessions`` key of a session of this handle's identity (arguments checked by ``inputs``)."""
        inputs.check_session(session_id, namespace)
        id_key = self.ctx.id_key
        return keys.session_key(id_key, namespace_key(id_key, namespace), session_id)

    def scoped_session_key(self, session_id: str, namespace: str) -> bytes:
        """``session_key`` for a call that needs an identity (an identity-blind handle refuses)."""
        self.ctx.check_scoped("a session call")
        return self.session_key(session_id, namespace)

    def manifest(self, snapshot_id: str) -> Manifest:
        """A snapshot's manifest by id (any identity)."""
        snapshot_id = inputs.check_snapshot_id(snapshot_id)
        with self.ctx.index.read() as txn:
            return self.in_txn(txn, sid_bytes(snapshot_id))

    def has(self, snapshot_id: str) -> bool:
        with self.ctx.index.read() as txn:
            return txn.get("manifests", bytes.fromhex(snapshot_id)) is not None

    def in_txn(self, txn, sid: bytes) -> Manifest:
        m = tables.manifest(txn, sid)
        if m is None:
            raise SnapshotNotFound(f"snapshot {sid.hex()} is not in the store at {self.ctx.root}")
        return m

    def check_identity(self, manifest: Manifest) -> None:
        for name in ("model_id", "config_fingerprint", "tokenizer_hash"):
            stored, expected = getattr(manifest, name), getattr(self.ctx.identity, name)
            if stored != expected:
                raise IdentityMismatch(name, stored, expected, f"snapshot {manifest.snapshot_id}")

    def latest(self, txn, session_id: str, namespace: str) -> Manifest:
        """The manifest of the session's latest snapshot (``_explain_missing`` raises when there is none)."""
        skey = self.session_key(session_id, namespace)
        sid = txn.get("sessions", skey)
        if sid is None:
            self._explain_missing(txn, session_id, namespace, skey)
        raw = txn.get("manifests", sid)
        where = f"session {session_id!r} (namespace {namespace!r})"
        if raw is None:  # one read transaction: a session pointing nowhere is a damaged record, not a race
            raise CorruptData(f"{where} points to snapshot {bytes(sid).hex()}, which is not indexed "
                              f"(a damaged index record: run `kvshelf verify`)")
        m = schema.decode(raw, Manifest, f"manifest {bytes(sid).hex()} of {where}")
        if (m.session_id, m.namespace) != (session_id, namespace) or keys.identity_key_of(m) != self.ctx.id_key:
            raise CorruptData(f"{where} points to snapshot {m.snapshot_id} of session {m.session_id!r} "
                              f"(namespace {m.namespace!r}): a damaged index record, refused")
        return m

    def sessions(self, namespace: str | None, touched: dict[bytes, int]) -> list[SessionInfo]:
        """This identity's sessions (all namespaces when ``namespace`` is None), most recently used first;
        ``touched``: the handle's uses not yet written."""
        id_key = self.ctx.id_key
        prefix = id_key if namespace is None else id_key + namespace_key(id_key, namespace)
        out = []
        with self.ctx.index.read() as txn:
            for _key, sid in txn.range("sessions", prefix, keys.after_prefix(prefix)):
                s = tables.summary(txn, sid)
                if s is None:
                    continue
                if keys.is_checkpoint(s.session_id):  # a session's checkpoint, not a session (list_checkpoints)
                    continue
                used = max(s.last_used_ns, touched.get(bytes(sid), 0))
                out.append(SessionInfo(s.session_id, s.namespace, bytes(sid).hex(), s.length, s.nbytes,
                                       s.created_at, used / 1e9))
        out.sort(key=lambda s: -s.last_used)
        return out

    def _explain_missing(self, txn, session_id: str, namespace: str, skey: bytes):
        raw = txn.get("quarantine", skey)
        if raw is not None:
            try:
                sid_hex, reason = msgspec.msgpack.decode(raw)
            except (msgspec.DecodeError, ValueError, TypeError):
                sid_hex, reason = "?", "its quarantine record is damaged too"
            raise CorruptData(f"session {session_id!r} (namespace {namespace!r}) was quarantined: snapshot "
                              f"{sid_hex}: {reason}")
        tail = session_id.encode("utf-8", "surrogatepass")
        for key, sid in txn.range("sessions"):
            if key[32:] == tail and key[:16] != self.ctx.id_key:
                other = self.in_txn(txn, sid)
                if other.namespace == namespace:
                    self.check_identity(other)
        raise SnapshotNotFound(f"no session {session_id!r} in namespace {namespace!r} for model "
                               f"{self.ctx.identity.model_id!r} in the store at {self.ctx.root}")


__all__ = ["Snapshots", "sid_bytes"]
