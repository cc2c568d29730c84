"""What the soak saves and how it knows the truth: self-describing sessions and exact comparisons.

A session's tokens start with ``[kind id, seed]`` and continue with tokens drawn from that seed; its caches are drawn
from the same seed, row by row (prefix-consistent: the first p rows of an n-row session are the p-row session). So
any restored snapshot names its own truth — a process reading another process's session can check it bit for bit —
and the soak's tables (session -> acceptable versions) catch a healthy-looking snapshot under the wrong name.

Only the public API is used (``open_store``, ``save``/``restore``/``restore_prefix``/``verify``, the codecs'
``default_provider.snapshot`` for fingerprints), so the soak runs on any store layout.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx
import numpy as np

from kvshelf import Identity, open_store
from kvshelf.codecs import default_provider
from kvshelf.codecs.header import encode_entry
from kvshelf.errors import KvShelfError, SnapshotNotFound
from kvshelf.latent_legos import KvScheme, LatentGeometry, composed_latent_cache
from kvshelf.latent_legos.kv import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    TurboQuantKVCache,
)

IDENTITY = Identity("soak-model", config_fingerprint="soak-cfg", tokenizer_hash="soak-tok")
CHUNK = 16
SOAK_KEY_VAR = "KVSHELF_SOAK_KEY"  # hex; ``--encrypted`` sets it for every process of the run


def at_rest() -> dict:
    """``open_store``'s options for the soak's stores: encrypted at rest when ``KVSHELF_SOAK_KEY`` is set, so every
    kill, flip, heal and mixed-traffic worker runs against sealed chunks (issue 29)."""
    key = os.environ.get(SOAK_KEY_VAR)
    return {"key": bytes.fromhex(key)} if key else {}
LAYERS = 2
GEOMETRY = LatentGeometry(kv_lora_rank=32, rope_head_dim=32, index_head_dim=32)
LATENT = {"mla": (KvScheme.bf16(), None), "affine": (KvScheme.affine(4, 32), None), "turbo": (KvScheme.turbo(8, 3), None),
          "paged": (KvScheme.bf16(), 8), "paged-affine": (KvScheme.affine(8, 32), 8)}
KV = {"kv": KVCache, "qkv": lambda: QuantizedKVCache(group_size=32, bits=8), "turbokv": lambda: TurboQuantKVCache(8, 3),
      "rotating": lambda: RotatingKVCache(512, 4)}
KINDS = [*LATENT, *KV]
JUNK = 2**31 - 1  # a token id no session holds: ends every prefix prompt


def tokens_for(kind: str, seed: int, n: int) -> list[int]:
    rest = np.random.default_rng([seed, 7]).integers(0, 50_000, max(0, n - 2)).tolist()
    return [KINDS.index(kind), seed, *rest][:n]


def truth_of(tokens: list[int]) -> tuple[str, int] | None:
    """The (kind, seed) a session's tokens claim, or None when they cannot be a soak session's."""
    if len(tokens) < 2 or not 0 <= tokens[0] < len(KINDS):
        return None
    return KINDS[tokens[0]], tokens[1]


def make_caches(kind: str, n: int, seed: int) -> list:
    caches = []
    for layer in range(LAYERS):
        def draw(j: int, shape: tuple[int, ...], layer: int = layer) -> np.ndarray:  # a stream per tensor: rows
            return np.random.default_rng([seed, layer, j]).standard_normal(shape).astype(np.float32)  # prefix-consistent

        if kind in LATENT:
            scheme, block = LATENT[kind]
            cache = composed_latent_cache(scheme, block, layer, GEOMETRY)
            cache.append_latent(*(mx.array(draw(j, (1, n, 32))) for j in range(3)))
        else:
            cache = KV[kind]()
            k, v = (mx.array(draw(j, (n, 2, 64)).transpose(1, 0, 2)[None]) for j in range(2))
            cache.update_and_fetch(k.astype(mx.bfloat16), v.astype(mx.bfloat16))
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def fingerprint(caches) -> str:
    """Every layer's entry with per-tensor checksums (so every stored byte and the geometry), as one digest."""
    h = hashlib.blake2b(digest_size=16)
    for cache in caches:
        entry, _arrays = default_provider.snapshot(cache)
        h.update(encode_entry(entry))
    return h.hexdigest()


def prefix_reads(kind: str, caches) -> str | None:
    """What a cut cache reads (latent kinds: every stored position; plain KV kinds: the codec's planes; a ring that
    has not wrapped: its rows up to the offset, since a cut keeps the longer buffer); None for a wrapped ring (never
    cut)."""
    h = hashlib.blake2b(digest_size=16)
    for cache in caches:
        if kind in LATENT:
            state = cache.read_latent()
            arrays = [state.latent, state.rope, *([state.index_keys] if state.index_keys is not None else [])]
        elif kind == "rotating":
            if cache.offset > cache.max_size:
                return None
            arrays = [a[..., :cache.offset, :] for a in cache.state]
        else:
            arrays = default_provider.snapshot(cache, checksums=False)[1]
        for a in arrays:
            h.update(np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes())
    return h.hexdigest()


_MEMO: dict[tuple, str | None] = {}


def truth_fingerprint(kind: str, seed: int, n: int) -> str:
    key = ("full", kind, seed, n)
    if key not in _MEMO:
        _MEMO[key] = fingerprint(make_caches(kind, n, seed))
    return _MEMO[key]


def truth_prefix(kind: str, seed: int, n: int) -> str | None:
    key = ("prefix", kind, seed, n)
    if key not in _MEMO:
        if len(_MEMO) > 4000:
            _MEMO.clear()
        _MEMO[key] = prefix_reads(kind, make_caches(kind, n, seed))
    return _MEMO[key]


@dataclass
class Verdict:
    """One trial's outcome: the worst of its checks (crash > wrong > lost > detected > exact)."""

    status: str = "exact"
    notes: list[str] = field(default_factory=list)
    present: dict[str, list | None] = field(default_factory=dict)  # "ns/sid" -> [kind, seed, n] found (or None)

    RANK: ClassVar[dict[str, int]] = {"exact": 0, "detected": 1, "lost": 2, "wrong": 3, "crash": 4}

    def worse(self, status: str, note: str) -> None:
        if self.RANK[status] > self.RANK[self.status]:
            self.status = status
        if len(self.notes) < 4:
            self.notes.append(f"{status}: {note}"[:300])


def check_restored(r, versions: list) -> str | None:
    """None when the restored session equals one acceptable version, else what differs."""
    claimed = truth_of(r.tokens)
    for v in versions:
        if v is None:
            continue
        kind, seed, n = v
        if r.tokens == tokens_for(kind, seed, n) and claimed == (kind, seed):
            if fingerprint(r.caches) == truth_fingerprint(kind, seed, n):
                return None
            return f"caches differ from {kind}/{seed}/{n}"
    return f"tokens {r.tokens[:4]}... (len {len(r.tokens)}) match no acceptable version {versions}"


def check_store(root: str, sessions: list, *, damaged: bool, rebuild: bool = False, deep: bool = True,
                prefix: bool = True) -> Verdict:
    """Restore every session of ``sessions`` ([ns, sid, versions, committed]) and a prefix of each, then verify.

    ``damaged``: the trial broke bytes on purpose, so an error is a detection and a missing session is lost only if
    nothing (an error, a verify finding) said so. Otherwise (a kill -9) a committed session must restore exactly:
    missing or unreadable is lost."""
    out = Verdict()
    missing, said = [], False
    try:
        if rebuild:
            with open_store(root, admin=True, **at_rest()) as admin:
                admin.rebuild_index()
        with open_store(root, identity=IDENTITY, chunk_tokens=CHUNK, **at_rest()) as store:
            for ns, sid, versions, _committed in sessions:
                key = f"{ns}/{sid}"
                try:
                    r = store.restore(sid, namespace=ns)
                except SnapshotNotFound:
                    out.present[key] = None
                    if None not in versions:
                        missing.append(key)
                    continue
                except KvShelfError as exc:
                    said = True
                    out.worse("detected" if damaged or None in versions else "lost",
                              f"{key}: {type(exc).__name__}: {exc}")
                    continue
                problem = check_restored(r, versions)
                if problem is not None:
                    out.worse("wrong", f"{key}: {problem}")
                    continue
                out.present[key] = [*truth_of(r.tokens), len(r.tokens)]
                if prefix:
                    _check_prefix(store, r.tokens, ns, out)
            try:
                findings = store.verify(deep=deep)
                said = said or bool(findings)
            except KvShelfError as exc:
                said = True
                out.worse("detected", f"verify: {type(exc).__name__}: {exc}")
    except KvShelfError as exc:
        said = True
        out.worse("detected", f"open: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - exactly what the soak counts
        out.worse("crash", f"{type(exc).__name__}: {exc}")
    for key in missing:
        out.worse("detected" if said and damaged else "lost", f"{key} is gone")
    return out


def _check_prefix(store, tokens: list[int], ns: str, out: Verdict) -> None:
    k = max(2, len(tokens) // 2 + 1)
    prompt = [*tokens[:k], JUNK]
    try:
        r = store.restore_prefix(prompt, namespace=ns)
    except KvShelfError as exc:
        out.worse("detected", f"prefix of {len(prompt)}: {type(exc).__name__}: {exc}")
        return
    if r is None:
        return
    if r.length > k or r.tokens != prompt[:r.length] or len(r.tokens) != r.length:
        out.worse("wrong", f"prefix restore gave {r.length} tokens not a prefix of the prompt")
        return
    claimed = truth_of(r.tokens)
    if claimed is not None and r.length >= 2:
        want = truth_prefix(claimed[0], claimed[1], r.length)
        got = prefix_reads(claimed[0], r.caches)
        if want is not None and got != want:
            out.worse("wrong", f"prefix restore of {r.length} reads differ from the truth")


__all__ = ["IDENTITY", "CHUNK", "KINDS", "tokens_for", "truth_of", "make_caches", "fingerprint", "Verdict",
           "check_store", "check_restored"]
