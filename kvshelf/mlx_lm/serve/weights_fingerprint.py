"""A content fingerprint of a model's weight files, remembered in a small sidecar so a restart re-reads nothing.

Why content: a prompt cache is valid for the exact weights that computed it, wherever those weights sit. A path
names a place, not the weights: the same model copied to another directory (or mounted at another path on a second
host sharing the Redis tier) is the same model, and other weights of the same shapes written to the same directory
are not. So the model id is xxh3-128 over every weight file's name, size and xxh3-128 of its bytes.

Why a sidecar: hashing reads every byte (gigabytes), at disk speed, once. The digest of each file is remembered in
``model-fingerprints.json`` inside the store directory, keyed by the file's real path, size, ``st_mtime_ns``,
``st_ctime_ns``, inode and device. Exact enough because every ordinary way to change a file's bytes changes one of
them: a write moves mtime and ctime (ctime cannot be set back from user space, so even ``touch -d`` after an
in-place edit of the same size is caught), a replacement by rename or a copy gets a new inode, another disk another
device. What invalidates an entry: any of those fields differing; then the file is hashed again and the entry
replaced (entries of files that no longer exist are dropped at the next write, so the sidecar stays small). What it cannot catch: bytes changed under the file system (a raw block-device write, a corrupted disk),
which no metadata sees; ``kvshelf verify`` of the weights is not this module's job. A stale or damaged sidecar costs
one re-hash, never a wrong identity: it is only ever a cache of what hashing would say.

Concurrency: servers sharing a store each read the sidecar, add what they hashed and replace it atomically (temp
file + rename), merging what is on disk at that moment; a lost update only costs another process one re-hash. A
store directory that cannot be written (read-only mount) just means hashing at each start.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
from pathlib import Path

import xxhash

log = logging.getLogger("kvshelf.serve")

SIDECAR_NAME = "model-fingerprints.json"
WEIGHT_PATTERNS = ("*.safetensors",)  # what mlx-lm's load reads as weights (model and adapter directories)
_CHUNK = 8 << 20
_FORMAT = "kvshelf-weight-fingerprints-v1"


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_digest(path: str | os.PathLike) -> str:
    """xxh3-128 (hex) of a file's bytes, read in 8 MiB pieces."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class FingerprintSidecar:
    """The remembered digests of weight files (``None`` path: remember nothing, hash every time).

    ``hashed`` counts the files this instance read in full (what a test or benchmark checks to tell warm from
    cold without timing)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path is not None else None
        self.hashed = 0
        self._entries: dict[str, dict] = self._read() if self.path is not None else {}
        self._dirty = False

    @classmethod
    def in_store(cls, store_dir: str | os.PathLike | None) -> FingerprintSidecar:
        return cls(Path(store_dir) / SIDECAR_NAME if store_dir is not None else None)

    def _read(self) -> dict[str, dict]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # a damaged sidecar only costs a re-hash
            log.warning("kvshelf: ignoring the weight fingerprint sidecar %s (%s: %s); hashing again",
                        self.path, type(exc).__name__, exc)
            return {}
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("files"), dict):
            return {}
        return {k: v for k, v in doc["files"].items() if isinstance(v, dict)}

    def digest(self, path: Path) -> tuple[int, str]:
        """(size, xxh3-128 hex) of the file at ``path``, from the sidecar when its stat key still matches."""
        real = os.path.realpath(path)
        st = os.stat(real)
        key = _stat_key(st)
        known = self._entries.get(real)
        if known is not None and known.get("stat") == key and isinstance(known.get("xxh3"), str):
            return st.st_size, known["xxh3"]
        digest = file_digest(real)
        self.hashed += 1
        if os.stat(real).st_mtime_ns == st.st_mtime_ns:  # not remembered if the file changed while it was read
            self._entries[real] = {"stat": key, "xxh3": digest}
            self._dirty = True
        return st.st_size, digest

    def save(self) -> None:
        """Write what was hashed (merged with what another process wrote meanwhile); failures only log."""
        if self.path is None or not self._dirty:
            return
        try:
            merged = self._read()
            merged.update(self._entries)
            merged = {k: v for k, v in merged.items() if os.path.exists(k)}  # bounded: files gone are forgotten
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".fingerprints.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": _FORMAT, "files": merged}, f, sort_keys=True)
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError as exc:
            log.warning("kvshelf: cannot write the weight fingerprint sidecar %s (%s: %s); the next start hashes "
                        "the weights again", self.path, type(exc).__name__, exc)


def weight_files(model_dir: Path) -> list[Path]:
    return sorted({f for pattern in WEIGHT_PATTERNS for f in model_dir.glob(pattern) if f.is_file()})


def weights_fingerprint(model_dir: Path, sidecar: FingerprintSidecar) -> str:
    """xxh3-128 (hex) over each weight file's name, size and content digest, in name order."""
    h = xxhash.xxh3_128(_FORMAT.encode() + b"\0")
    for f in weight_files(model_dir):
        size, digest = sidecar.digest(f)
        name = f.name.encode()
        h.update(struct.pack("<QQ", len(name), size) + name + bytes.fromhex(digest))
    return h.hexdigest()


__all__ = ["SIDECAR_NAME", "FingerprintSidecar", "file_digest", "weight_files", "weights_fingerprint"]
