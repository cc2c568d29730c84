"""Encryption at rest: the sealed chunk envelope, keyed chunk names, and the keyring that holds each tenant's data key.

Why chunk-level sealing: a chunk is the unit the store writes, deduplicates, verifies, heals and ships to the shared
tier, so sealing it once, where its frame is built, covers the packs, the shared tier's values and every copy made
of them. A sealed chunk is ``SEAL_MAGIC | key id (16) | nonce (12) | AES-256-GCM(content hash (16) | frame) | tag``
with the magic, key id and chunk name as associated data: a flipped byte, a chunk moved under another name or
another tenant's key fails the tag (``CorruptData``: healed or quarantined as today). After opening, the content
hash inside is checked against the plaintext exactly as for a plain chunk, and the name against the content hash.

Nonces: 96 random bits per seal (``os.urandom``), never a counter — several processes seal with one tenant's key at
once and share no state; random nonces stay below a 2^-32 collision chance for 2^32 seals per key (NIST SP 800-38D),
and each tenant has its own key.

Names: an encrypted tenant's chunk is named ``HMAC-SHA256(name key, content hash)[:16]``: the same content gives the
same name within a tenant (deduplication works) and unrelated names across tenants (the store no longer says that
two tenants hold the same bytes).

Keys: the master key (32 bytes, or a passphrase through scrypt with a salt kept in ``keys/master``) only wraps. Each
tenant gets a *random* 32-byte data key, wrapped by the master and kept in ``keys/<key id>``; the seal and name keys
are HKDF of it. Why random and wrapped rather than HKDF(master, tenant): a derived key can never be destroyed (the
master derives it again), a wrapped one is gone once its file is — ``forget_tenant`` deletes it first, so no copy of
a pack or Redis value made earlier can be opened again. (A copy of ``keys/`` itself taken earlier, with the master,
still opens it: keep ``keys/`` out of backups you cannot destroy, see SECURITY.md.)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from ...errors import CorruptData, EncryptionKeyError, WrongArgumentType
from ..base.syncs import ensure_dir, fsync, fsync_dir

SEAL_MAGIC = b"KVSHE01\n"
HEAD = len(SEAL_MAGIC) + 16 + 12  # magic, key id, nonce
TAG = 16
KEY_BYTES = 32
_CHECK = b"kvshelf-master-key-check-v1"
SCRYPT = {"n": 1 << 15, "r": 8, "p": 1}


class MissingDataKey(EncryptionKeyError, CorruptData):
    """A sealed chunk names a data key the store does not hold: its tenant was forgotten, or the key id bytes were
    damaged. Both an ``EncryptionKeyError`` and ``CorruptData``: a restore treats the chunk as unreadable (its snapshot
    quarantined, the copy marked bad, as for a failed tag), never as garbage."""


def _hkdf(key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(key)


def key_id(token: str) -> bytes:
    """16 bytes naming a tenant's data key (its file, and every sealed chunk of the tenant)."""
    return hashlib.sha256(b"kvshelf-tenant-key-id-v1\x00" + token.encode("utf-8", "surrogatepass")).digest()[:16]


def is_sealed(head: bytes | memoryview) -> bool:
    return bytes(head[:len(SEAL_MAGIC)]) == SEAL_MAGIC


class TenantKey:
    """One tenant's data key, opened: seals, opens and names its chunks."""

    def __init__(self, kid: bytes, data_key: bytes):
        self.kid = kid
        self._aead = AESGCM(_hkdf(data_key, b"kvshelf-chunk-seal-v1"))
        self._name_key = _hkdf(data_key, b"kvshelf-chunk-name-v1")

    def name(self, content_hash: str) -> str:
        """The chunk's keyed name (module docstring)."""
        return hmac.new(self._name_key, bytes.fromhex(content_hash), hashlib.sha256).digest()[:16].hex()

    def seal(self, name: str, content_hash: str, frame: list) -> bytearray:
        """The sealed envelope of one chunk frame (a list of buffers, joined once here; the cipher writes straight
        into the envelope)."""
        nonce = os.urandom(12)
        head = SEAL_MAGIC + self.kid + nonce
        body = b"".join([bytes.fromhex(content_hash), *frame])
        out = bytearray(HEAD + len(body) + TAG)
        out[:HEAD] = head
        self._aead.encrypt_into(nonce, body, head + bytes.fromhex(name), memoryview(out)[HEAD:])
        return out

    def open(self, name: str, blob: bytes | memoryview, where: str) -> tuple[str, memoryview]:
        """(content hash, frame) of a sealed chunk named ``name``; ``CorruptData`` when the tag fails, and when the
        name is not the keyed name of the content hash inside."""
        blob = memoryview(blob).cast("B")
        if len(blob) < HEAD + TAG + 16:
            raise CorruptData(f"sealed chunk {where} is truncated ({len(blob)} bytes)")
        head, nonce = bytes(blob[:HEAD]), bytes(blob[HEAD - 12:HEAD])
        plain = bytearray(len(blob) - HEAD - TAG)
        try:
            self._aead.decrypt_into(nonce, blob[HEAD:], head + bytes.fromhex(name), plain)
        except InvalidTag:
            raise CorruptData(f"sealed chunk {where} fails its authentication tag (damaged, truncated or not this "
                              f"chunk)") from None
        content = bytes(plain[:16]).hex()
        if self.name(content) != name:
            raise CorruptData(f"sealed chunk {where}: its content hash does not give its name")
        return content, memoryview(plain)[16:]


class KeyRing:
    """The store's keys (``<store>/keys/``): the master check record and one wrapped data key per tenant.

    ``KeyRing.open(root, key)``: ``key`` is 32 bytes or a passphrase str; a store without ``keys/master`` is made
    encrypted by its first keyed open. ``locked(root)``: an encrypted store opened without a key (offline tools):
    every seal or open raises ``EncryptionKeyError``; ``verify`` checks what it can without opening chunks."""

    def __init__(self, root: str, kek: AESGCM | None):
        self.root, self.dir, self._kek = root, os.path.join(root, "keys"), kek
        self._keys: dict[bytes, TenantKey] = {}
        self._lock = threading.Lock()

    @staticmethod
    def encrypted(root: str) -> bool:
        return os.path.exists(os.path.join(root, "keys", "master"))

    @classmethod
    def locked(cls, root: str) -> KeyRing:
        return cls(root, None)

    @classmethod
    def open(cls, root: str, key: bytes | str, create: bool = True) -> KeyRing:
        if isinstance(key, (bytes, bytearray, memoryview)):
            if len(key) != KEY_BYTES:
                raise EncryptionKeyError(f"the encryption key for the store at {root} must be {KEY_BYTES} bytes "
                                         f"(or a passphrase str), got {len(key)} bytes")
        elif isinstance(key, str):
            if not key:
                raise EncryptionKeyError(f"the passphrase for the store at {root} is empty")
        else:
            raise WrongArgumentType(f"key must be 32 bytes or a passphrase str, got {type(key).__name__}")
        path = os.path.join(root, "keys", "master")
        try:
            with open(path, "rb") as f:
                record = json.loads(f.read())
        except FileNotFoundError:
            if not create:
                raise EncryptionKeyError(f"the store at {root} is not encrypted") from None
            record = cls._new_master(root, key)
        except (OSError, ValueError) as exc:
            raise EncryptionKeyError(f"the key record keys/master of the store at {root} cannot be read "
                                     f"({type(exc).__name__})") from None
        if not isinstance(record, dict) or record.get("kdf") not in ("scrypt", "raw"):
            raise EncryptionKeyError(f"the key record keys/master of the store at {root} is damaged")
        if (record["kdf"] == "scrypt") != isinstance(key, str):
            raise EncryptionKeyError(f"wrong key for the store at {root}: it was encrypted with "
                                     f"{'a passphrase' if record['kdf'] == 'scrypt' else 'a 32-byte key'}")
        try:
            kek = AESGCM(cls._kek_bytes(key, record))
            check = bytes.fromhex(record["check"])
            if len(check) < 12 + TAG:
                raise InvalidTag
            if kek.decrypt(check[:12], check[12:], _CHECK) != _CHECK:
                raise InvalidTag
        except InvalidTag:
            raise EncryptionKeyError(f"wrong key for the store at {root}: the key check fails (or keys/master is "
                                     f"damaged)") from None
        except (KeyError, ValueError, TypeError, OverflowError, MemoryError):  # a damaged record's fields
            raise EncryptionKeyError(f"the key record keys/master of the store at {root} is damaged") from None
        return cls(root, kek)

    @staticmethod
    def _kek_bytes(key: bytes | str, record: dict) -> bytes:
        if isinstance(key, str):
            salt = bytes.fromhex(record["salt"])
            raw = Scrypt(salt=salt, length=KEY_BYTES, n=record["n"], r=record["r"], p=record["p"]).derive(
                key.encode("utf-8", "surrogatepass"))
        else:
            raw = bytes(key)
        return _hkdf(raw, b"kvshelf-key-wrapping-v1")

    @classmethod
    def _new_master(cls, root: str, key: bytes | str) -> dict:
        record: dict = {"version": 1, "kdf": "scrypt" if isinstance(key, str) else "raw"}
        if isinstance(key, str):
            record.update(salt=os.urandom(16).hex(), **SCRYPT)
        nonce = os.urandom(12)
        record["check"] = (nonce + AESGCM(cls._kek_bytes(key, record)).encrypt(nonce, _CHECK, _CHECK)).hex()
        keys_dir = os.path.join(root, "keys")
        ensure_dir(keys_dir)
        _write_new(keys_dir, "master", json.dumps(record).encode())
        with open(os.path.join(keys_dir, "master"), "rb") as f:  # a concurrent first open may have won the race
            return json.loads(f.read())

    # ------------------------------------------------------------------ tenants' data keys
    def _check_unlocked(self, what: str) -> AESGCM:
        if self._kek is None:
            raise EncryptionKeyError(f"the store at {self.root} is encrypted at rest: {what} needs its key "
                                     f"(open_store(..., key=...), --encryption-key-file)")
        return self._kek

    def for_tenant(self, token: str) -> TenantKey:
        """The tenant's data key, made (random, wrapped, durable) on its first use."""
        kid = key_id(token)
        got = self._cached(kid)
        if got is not None:
            return got
        kek = self._check_unlocked("a save")
        with self._lock:
            try:
                return self.by_id(kid, "a save")
            except EncryptionKeyError:
                pass
            data_key = os.urandom(KEY_BYTES)
            nonce = os.urandom(12)
            _write_new(self.dir, kid.hex(), nonce + kek.encrypt(nonce, data_key, b"kvshelf-data-key-v1" + kid))
        return self.by_id(kid, "a save")  # whichever process created it first: its key is the tenant's

    def _cached(self, kid: bytes) -> TenantKey | None:
        """A key this handle opened, while its file still exists: another process's ``forget_tenant`` destroys it
        for every handle (one ``stat`` per save or chunk read), so none seals new chunks under a forgotten key."""
        got = self._keys.get(kid)
        if got is not None and not os.path.exists(os.path.join(self.dir, kid.hex())):
            self._keys.pop(kid, None)
            return None
        return got

    def by_id(self, kid: bytes, what: str = "reading a chunk") -> TenantKey:
        got = self._cached(bytes(kid))
        if got is not None:
            return got
        kek = self._check_unlocked(what)
        try:
            with open(os.path.join(self.dir, bytes(kid).hex()), "rb") as f:
                wrapped = f.read()
        except FileNotFoundError:
            raise MissingDataKey(f"the store at {self.root} holds no data key {bytes(kid).hex()} (its tenant was "
                                 f"forgotten, or the chunk is damaged or comes from another store)") from None
        try:
            if len(wrapped) != 12 + KEY_BYTES + TAG:  # truncated or padded: damaged, and AES-GCM needs 12 bytes
                raise InvalidTag
            data_key = kek.decrypt(wrapped[:12], wrapped[12:], b"kvshelf-data-key-v1" + bytes(kid))
        except (InvalidTag, ValueError):
            raise EncryptionKeyError(f"data key {bytes(kid).hex()} of the store at {self.root} does not open with "
                                     f"this master key (damaged, or from another store)") from None
        got = self._keys[bytes(kid)] = TenantKey(bytes(kid), data_key)
        return got

    def open_chunk(self, name: str, blob: bytes | memoryview, where: str) -> tuple[str, memoryview]:
        """(content hash, plain frame) of a sealed chunk, under the data key its envelope names."""
        if len(blob) < HEAD:
            raise CorruptData(f"sealed chunk {where} is truncated ({len(blob)} bytes)")
        return self.by_id(bytes(blob[len(SEAL_MAGIC):len(SEAL_MAGIC) + 16]), f"reading chunk {where}").open(
            name, blob, where)

    def destroy(self, token: str) -> bool:
        """Delete the tenant's wrapped data key for good (durable when this returns); True when there was one."""
        kid = key_id(token)
        with self._lock:
            self._keys.pop(kid, None)
            try:
                os.unlink(os.path.join(self.dir, kid.hex()))
            except FileNotFoundError:
                return False
            fsync_dir(self.dir)
        return True

    def key_ids(self) -> list[str]:
        """The key ids held (hex), for tests and ``kvshelf stats``."""
        try:
            return sorted(n for n in os.listdir(self.dir) if n != "master" and not n.startswith("."))
        except FileNotFoundError:
            return []


def read_key_file(path: str) -> bytes | str:
    """An encryption key file (``--encryption-key-file``, ``KVSHELF_ENCRYPTION_KEY_FILE``): exactly 32 bytes are a raw
    key, 64 hexadecimal digits (a newline may follow) a raw key written as text, anything else a UTF-8 passphrase (one
    trailing newline dropped). ``EncryptionKeyError`` naming the file — never its contents — when it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
    except OSError as exc:
        raise EncryptionKeyError(f"cannot read the encryption key file {path}: {exc.strerror or exc}") from None
    if len(raw) == KEY_BYTES:
        return raw
    text = raw[:-1] if raw.endswith(b"\n") else raw
    if len(text) == 2 * KEY_BYTES and all(c in b"0123456789abcdefABCDEF" for c in text):
        return bytes.fromhex(text.decode())
    try:
        passphrase = text.decode("utf-8")
    except UnicodeDecodeError:
        raise EncryptionKeyError(f"the encryption key file {path} is neither 32 bytes, 64 hex digits nor UTF-8 "
                                 f"text") from None
    if not passphrase:
        raise EncryptionKeyError(f"the encryption key file {path} is empty")
    return passphrase


def _write_new(directory: str, name: str, data: bytes) -> bool:
    """Write ``directory/name`` durably, only if it does not exist (link of a synced temporary): False if it did."""
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, os.path.join(directory, name))
        made = True
    except FileExistsError:
        made = False
    finally:
        os.unlink(tmp)
    fsync_dir(directory)
    return made


__all__ = ["HEAD", "KeyRing", "MissingDataKey", "SEAL_MAGIC", "TenantKey", "is_sealed", "key_id", "read_key_file"]
