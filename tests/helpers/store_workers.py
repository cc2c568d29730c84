"""Deterministic session data, and the subprocess workers of the store's crash and concurrency tests.

Why deterministic: a worker killed with SIGKILL cannot tell the test what it saved, so everything a worker saves
is a pure function of ``(session id, length)`` and a worker's whole plan is a pure function of its seed. The test
recomputes the expected tokens and tensors for whatever it finds in the store and compares them bit for bit.

Sessions belong to a *family* (named in the id, ``f<k>-...``): every session of a family starts with the family's
system prompt (the same tokens and the same tensors), so chunks are shared between sessions, and a session saved at
growing lengths shares its earlier chunks with itself.

Run as a script: ``python store_workers.py crash --store DIR --seed N --log FILE`` or
``python store_workers.py mixed --store DIR --seed N --seconds S --result FILE``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

CHUNK_TOKENS = 64
SYSTEM_TOKENS = 150  # a family's shared system prompt (two whole chunks and a partial one)
MAX_LEN = 700
FAMILIES = 3
VOCAB = 2**30  # own tokens of two sessions never collide in practice; VOCAB + k (k < 2**30) is never stored
MODEL_ID = "kvshelf-test-model"


def identity():
    from kvshelf import Identity

    return Identity(MODEL_ID, config_fingerprint="synthetic-2-layer", tokenizer_hash="none")


def open_test_store(path, **kwargs):
    from kvshelf import open_store

    return open_store(str(path), identity=identity(), chunk_tokens=CHUNK_TOKENS, **kwargs)


def _geometry():
    from kvshelf.latent_legos import LatentGeometry

    return LatentGeometry(kv_lora_rank=64, rope_head_dim=32, index_head_dim=32)


def make_empty_caches() -> list:
    """Layer 0: f32 MLA with a DSA index key; layer 1: affine 8-bit encoded latent cache."""
    from kvshelf.latent_legos import KvScheme, composed_latent_cache

    scheme = KvScheme.affine_layers({1: (8, 32)})
    geometry = _geometry()
    return [composed_latent_cache(scheme, None, layer, geometry) for layer in range(2)]


# ------------------------------------------------------------------------------------------------ session data


def family_of(session: str) -> int:
    if not session.startswith("f") or "-" not in session:
        raise ValueError(f"test session ids look like 'f<family>-<tag>' (got {session!r})")
    return int(session[1 : session.index("-")])


def xxh_int(*parts: object) -> int:
    """A stable 64-bit number for ``parts`` (Python's ``hash`` of a str changes between processes)."""
    import xxhash

    return xxhash.xxh64_intdigest("/".join(map(str, parts)).encode())


def _rng(*parts: object) -> np.random.Generator:
    return np.random.default_rng(xxh_int(*parts))


@lru_cache(maxsize=64)
def _family_data(family: int) -> tuple[tuple[int, ...], tuple[np.ndarray, ...]]:
    rng = _rng("family", family)
    tokens = tuple(int(t) for t in rng.integers(1, VOCAB, SYSTEM_TOKENS))
    planes = tuple(rng.standard_normal((2, SYSTEM_TOKENS, w), dtype=np.float32) for w in (64, 32, 32))
    return tokens, planes


@lru_cache(maxsize=512)
def _own_data(session: str) -> tuple[tuple[int, ...], tuple[np.ndarray, ...]]:
    rng = _rng("session", session)
    own = MAX_LEN - SYSTEM_TOKENS
    tokens = tuple(int(t) for t in rng.integers(1, VOCAB, own))
    planes = tuple(rng.standard_normal((2, own, w), dtype=np.float32) for w in (64, 32, 32))
    return tokens, planes


def session_tokens(session: str, length: int) -> list[int]:
    """The first ``length`` tokens of a session: its family's system prompt, then its own tokens."""
    if not 0 < length <= MAX_LEN:
        raise ValueError(f"length must be in [1, {MAX_LEN}] (got {length})")
    return (list(_family_data(family_of(session))[0]) + list(_own_data(session)[0]))[:length]


def session_planes(session: str, length: int) -> list[tuple[np.ndarray, ...]]:
    """Per layer, the (latent, rope, index_keys) float32 ``[1, length, w]`` the session's caches were fed."""
    fam, own = _family_data(family_of(session))[1], _own_data(session)[1]
    layers = []
    for layer in range(2):
        layers.append(
            tuple(np.concatenate([f[layer], o[layer]])[None, :length] for f, o in zip(fam, own, strict=True))
        )
    return layers


def build_caches(session: str, length: int) -> list:
    """Fresh caches holding the session's first ``length`` positions (one append per layer, evaluated)."""
    caches = make_empty_caches()
    for cache, planes in zip(caches, session_planes(session, length), strict=True):
        cache.append_latent(*(mx.array(p) for p in planes))
    mx.eval([c.state for c in caches])
    return caches


# ------------------------------------------------------------------------------------------------ comparison


def cache_digest(cache) -> tuple:
    """What a serial cache holds, as comparable bytes: kind, offset and every tensor the codec would store."""
    from kvshelf.codecs import default_provider

    entry, arrays = default_provider.for_cache(cache).snapshot(cache)
    tensors = []
    for array in arrays:
        if array.dtype == mx.bfloat16:
            array = array.view(mx.uint16)
        host = np.array(array)
        tensors.append((str(array.dtype), tuple(host.shape), host.tobytes()))
    return entry.kind, entry.offset, tuple(tensors)


@lru_cache(maxsize=256)
def expected_digests(session: str, length: int) -> tuple:
    return tuple(cache_digest(c) for c in build_caches(session, length))


def mismatch(caches, session: str, length: int) -> str | None:
    """None when ``caches`` hold exactly the session's first ``length`` positions, else what differs."""
    got = [cache_digest(c) for c in caches]
    want = expected_digests(session, length)
    if len(got) != len(want):
        return f"{session}@{length}: {len(got)} caches, expected {len(want)}"
    for layer, (g, w) in enumerate(zip(got, want)):
        if g[:2] != w[:2]:
            return f"{session}@{length} layer {layer}: kind/offset {g[:2]}, expected {w[:2]}"
        if len(g[2]) != len(w[2]):
            return f"{session}@{length} layer {layer}: {len(g[2])} tensors, expected {len(w[2])}"
        for i, (gt, wt) in enumerate(zip(g[2], w[2])):
            if gt[:2] != wt[:2]:
                return f"{session}@{length} layer {layer} tensor {i}: {gt[:2]}, expected {wt[:2]}"
            if gt[2] != wt[2]:
                return f"{session}@{length} layer {layer} tensor {i}: bytes differ"
    return None


def session_ids(store, namespace: str | None = "") -> list[str]:
    """The store's session ids (``sessions()`` may list ids or info records)."""
    out = []
    for item in store.sessions(namespace=namespace):
        out.append(item if isinstance(item, str) else item.session_id)
    return sorted(set(out))


# ------------------------------------------------------------------------------------------------ crash worker


@dataclass(frozen=True)
class Step:
    session: str
    length: int
    mode: str  # "save" or "async" (save_async then flush)


def grow_or_start(
    rng: random.Random, lengths: dict[str, int], tag: str, *, grow_p: float, grow_by: int, new_max: int
) -> tuple[str, int]:
    """The next save of a worker: grow one of its sessions below ``MAX_LEN`` (chance ``grow_p``), or start a new one."""
    growable = [s for s, n in lengths.items() if n < MAX_LEN]
    if growable and rng.random() < grow_p:
        session = rng.choice(growable)
        return session, min(MAX_LEN, lengths[session] + rng.randint(1, grow_by))
    return f"f{rng.randrange(FAMILIES)}-{tag}-s{len(lengths)}", rng.randint(1, new_max)


def crash_plan(seed: int, steps: int = 40) -> list[Step]:
    """A run's saves: new sessions at random lengths, and growth of the run's earlier sessions."""
    rng = random.Random(seed)
    lengths: dict[str, int] = {}
    plan = []
    for _ in range(steps):
        session, length = grow_or_start(rng, lengths, f"r{seed}", grow_p=0.45, grow_by=260, new_max=520)
        lengths[session] = length
        plan.append(Step(session, length, "async" if rng.random() < 0.25 else "save"))
    return plan


def planned_lengths(seed: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for step in crash_plan(seed):
        out.setdefault(step.session, []).append(step.length)
    return out


def run_crash_worker(store_dir: str, seed: int, log_path: str) -> int:
    """Save the plan of ``seed``, logging each save after it returned (the test kills us at random)."""
    plan = crash_plan(seed)
    with open(log_path, "a", buffering=1) as log:
        store = open_test_store(store_dir)
        log.write("ready\n")
        for step in plan:
            caches = build_caches(step.session, step.length)
            tokens = session_tokens(step.session, step.length)
            log.write(f"saving {step.session} {step.length}\n")  # a kill from here to "saved" lands mid-save
            if step.mode == "async":
                store.save_async(step.session, tokens, caches)
                store.flush()
            else:
                store.save(step.session, tokens, caches)
            log.write(f"saved {step.session} {step.length}\n")
        store.close()
        log.write("done\n")
    return 0


# ------------------------------------------------------------------------------------------------ mixed worker


@lru_cache(maxsize=1)
def caches_trimmable() -> bool:
    return all(c.is_trimmable() for c in build_caches("f0-probe", 3))


def run_mixed_worker(store_dir: str, seed: int, seconds: float, result_path: str) -> int:
    """Mixed save/restore/lookup/restore_prefix/restore_batch on a shared store until the deadline.

    Each worker grows its own sessions (``f<k>-p<seed>-s<j>``) and also saves two sessions every worker writes
    (``f<k>-shared-<j>``, last writer wins); every restore is checked bit-exact against the recomputed data. A failed
    operation is recorded and the worker carries on, so one run reports every kind of failure it meets.
    """
    rng = random.Random(seed)
    counts = {"save": 0, "restore": 0, "lookup": 0, "restore_prefix": 0, "restore_batch": 0}
    state = {"own": {}, "shared": set(), "tag": f"p{seed}"}
    errors: list[str] = []
    deadline = time.monotonic() + seconds
    store = open_test_store(store_dir)
    try:
        while time.monotonic() < deadline and len(errors) < 20:
            op = rng.choices(list(counts), weights=[3, 3, 2, 2, 1])[0]
            try:
                op = _mixed_step(store, rng, op, state, errors)
            except Exception as exc:  # noqa: BLE001 - reported to the test through the result file
                errors.append(f"{op}: {type(exc).__name__}: {exc}")
            if op is not None:
                counts[op] += 1
    except Exception:  # noqa: BLE001
        errors.append(traceback.format_exc())
    finally:
        try:
            store.close()
        except Exception:  # noqa: BLE001
            errors.append("close: " + traceback.format_exc())
        with open(result_path, "w") as f:
            json.dump({"counts": counts, "own": state["own"], "shared": sorted(state["shared"]), "errors": errors}, f)
    return 1 if errors else 0


def _mixed_step(store, rng: random.Random, op: str, state: dict, errors: list[str]) -> str | None:
    """One operation of the mixed worker; returns the operation run (None: nothing to do yet)."""
    own: dict[str, int] = state["own"]
    known = session_ids(store)
    if op == "save" or not known:
        op = "save"
        if rng.random() < 0.2:
            session = f"f{rng.randrange(FAMILIES)}-shared-{rng.randrange(2)}"
            length = rng.randint(1, MAX_LEN)
        else:
            session, length = grow_or_start(rng, own, state["tag"], grow_p=0.5, grow_by=200, new_max=500)
        info = store.save(session, session_tokens(session, length), build_caches(session, length))
        if "-shared-" in session:
            state["shared"].add(session)
        else:
            own[session] = length
        if info.length != length or info.session_id != session:
            errors.append(f"save {session}@{length} returned {info!r}")
    elif op == "restore":
        session = rng.choice(known)
        r = store.restore(session)
        if list(r.tokens) != session_tokens(session, r.length):
            errors.append(f"restore {session}: tokens differ at length {r.length}")
        elif session in own and r.length != own[session]:
            errors.append(f"restore {session}: length {r.length}, this worker last saved {own[session]}")
        elif (why := mismatch(r.caches, session, r.length)) is not None:
            errors.append(f"restore: {why}")
    elif op in ("lookup", "restore_prefix"):
        if not own:
            return None
        # own sessions only: their stored length is known, so the usable length is exact: the appended token is
        # never stored, and a cut below the stored length is served only when every cache is trimmable
        session = rng.choice(sorted(own))
        stored = own[session]
        cut = rng.randint(1, stored) if caches_trimmable() else stored
        prompt = session_tokens(session, cut) + [VOCAB + 1 + rng.randrange(1000)]
        if op == "lookup":
            hit = store.lookup(prompt)
            got = 0 if hit is None else hit.length
            if got != cut:
                errors.append(f"lookup {session}[:{cut}]+1 (stored {stored}): length {got}, expected {cut}")
            elif session_tokens(hit.session_id, hit.length) != prompt[: hit.length]:
                errors.append(f"lookup {session}[:{cut}]: hit {hit!r} tokens do not match the prompt")
        else:
            r = store.restore_prefix(prompt)
            got = 0 if r is None else r.length
            if got != cut:
                errors.append(f"restore_prefix {session}[:{cut}]+1 (stored {stored}): length {got}, expected {cut}")
            elif list(r.tokens) != prompt[: r.length]:
                errors.append(f"restore_prefix {session}[:{cut}]: tokens differ")
            elif (why := mismatch(r.caches, session, r.length)) is not None:
                errors.append(f"restore_prefix: {why}")
    else:
        pick = rng.sample(known, min(2, len(known)))
        batch = store.restore_batch(pick)
        for row, session in enumerate(pick):
            length = batch.lengths[row]
            if list(batch.tokens[row]) != session_tokens(session, length):
                errors.append(f"restore_batch row {row} ({session}): tokens differ")
                break
            rows = [c.extract_row(row) for c in batch.caches]
            if (why := mismatch(rows, session, length)) is not None:
                errors.append(f"restore_batch row {row}: {why}")
                break
    return op


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    crash = sub.add_parser("crash")
    crash.add_argument("--store", required=True)
    crash.add_argument("--seed", type=int, required=True)
    crash.add_argument("--log", required=True)
    mixed = sub.add_parser("mixed")
    mixed.add_argument("--store", required=True)
    mixed.add_argument("--seed", type=int, required=True)
    mixed.add_argument("--seconds", type=float, required=True)
    mixed.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "crash":
        return run_crash_worker(args.store, args.seed, args.log)
    return run_mixed_worker(args.store, args.seed, args.seconds, args.result)


if __name__ == "__main__":
    sys.exit(main())
