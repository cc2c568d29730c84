"""The shared tier's key layout, in one place (prefix ``P``, default ``"kvshelf:"``).

``P chunks/<hash>``           a chunk (a ``RedisByteStore`` object): u32 descriptor length | descriptor | tensor bytes
``P{<nsk>}:b:<boundary>``     sorted set, one per prefix boundary: members = the 16 following tokens (big-endian int64,
                               0xff-padded, as the local prefix index) + the 16-byte snapshot id, all scores 0 (lex order)
``P{<nsk>}:s:<sid>``          the snapshot's summary (sealed msgpack ``RemoteSummary``)
``P{<nsk>}:t:<sid>``          its tokens (sealed int64 little-endian)
``P{<nsk>}:m:<sid>``          its manifest (sealed msgpack, the local store's ``Manifest``)
``P{<nsk>}:sess``             hash: session id -> the session's latest snapshot id (hex)
``P pub:<uuid>``              a publish in progress (expires by itself): gc waits while one exists
``P gc``                      a gc in progress: publishers do not start while it exists

Everything of one (identity, namespace) shares the hash tag ``{<nsk hex>}``, so on a cluster it lives in one slot:
an index entry is committed in one ``MULTI``/``EXEC`` and a lookup's pipelines go to one node. Chunks carry no tag,
so they spread over every master. ``nsk`` is the local store's namespace key (``identity.namespace_key``).
"""

from __future__ import annotations


class Keys:
    def __init__(self, prefix: str):
        self.prefix = prefix

    def chunk_name(self, hash_: str) -> str:
        """The chunk's object name in the tier's ``RedisByteStore``."""
        return f"chunks/{hash_}"

    def chunk(self, hash_: str) -> str:
        return f"{self.prefix}chunks/{hash_}"

    def scope(self, nsk: bytes) -> str:
        return f"{self.prefix}{{{nsk.hex()}}}:"

    def boundary(self, nsk: bytes, boundary: bytes) -> str:
        return f"{self.scope(nsk)}b:{boundary.hex()}"

    def summary(self, nsk: bytes, sid: bytes) -> str:
        return f"{self.scope(nsk)}s:{sid.hex()}"

    def tokens(self, nsk: bytes, sid: bytes) -> str:
        return f"{self.scope(nsk)}t:{sid.hex()}"

    def manifest(self, nsk: bytes, sid: bytes) -> str:
        return f"{self.scope(nsk)}m:{sid.hex()}"

    def sessions(self, nsk: bytes) -> str:
        return f"{self.scope(nsk)}sess"

    def publishing(self, token: str) -> str:
        return f"{self.prefix}pub:{token}"

    @property
    def publishing_pattern(self) -> str:
        return f"{self.prefix}pub:*"

    @property
    def gc(self) -> str:
        return f"{self.prefix}gc"

    @property
    def summary_pattern(self) -> str:
        return f"{self.prefix}{{*}}:s:*"

    @property
    def chunk_pattern(self) -> str:
        return f"{self.prefix}chunks/*"

    def parse_summary_key(self, key: str) -> tuple[bytes, bytes]:
        """(nsk, sid) of a summary key."""
        rest = key[len(self.prefix):]
        nsk_hex, sid_hex = rest[1:33], rest.rsplit(":", 1)[1]
        return bytes.fromhex(nsk_hex), bytes.fromhex(sid_hex)


__all__ = ["Keys"]
