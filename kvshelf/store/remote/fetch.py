"""Fetching a remote snapshot's chunks into its destinations, verified: two paths, one contract.

* single server (``direct_reads``, the default): ``direct.fetch_into`` reads each pipelined ``GET`` reply from the
  socket straight into the destination arrays;
* cluster, or a snapshot holding the same chunk twice: redis-py pipelines, one batch fetched ahead on a helper
  thread while the previous one is hashed and copied (``fetch_ahead``).

Either way a chunk is verified (length, descriptor, content hash = its name) before anything is returned; a missing
one raises ``Missing``, a corrupt one is counted, deleted from the server and raises ``CorruptData``.
"""

from __future__ import annotations

import queue
import threading

from ...errors import CorruptData, EncryptionKeyError, KvShelfError
from ..base import seams
from . import direct, local



class Missing(KvShelfError):
    """A remote record or chunk that was there at lookup time is gone now."""


class NotOurs(KvShelfError):
    """A remote chunk sealed under a data key this store does not hold (another store's keys, a forgotten tenant):
    a miss for this host, and never damage — the entry stays for the hosts that hold the key."""


def filler(tier, refs):
    """The ``fill(dest, by_hash)`` for ``local.build_caches`` that suits this client and snapshot."""
    # a sealed chunk is opened whole before anything reads it: no streaming straight from the socket
    streams = tier.direct and tier.ctx.keys is None and direct.supported(tier.client)
    if streams and len({r.hash for r in refs}) == len(refs):
        return lambda dest, by_hash: fill_direct(tier, dest, by_hash)
    return local.fill_from(fetch_ahead(tier, refs))


def batches(tier, refs) -> list[list]:
    """Distinct chunks in order, grouped into pipelines of about ``fetch_batch_bytes``."""
    out, batch, size = [], [], 0
    for r in {r.hash: r for r in refs}.values():
        if batch and size + r.nbytes > tier.fetch_batch_bytes:
            out.append(batch)
            batch, size = [], 0
        batch.append(r)
        size += r.nbytes
    return [*out, batch] if batch else out


def fill_direct(tier, dest, by_hash) -> None:
    for i, batch in enumerate(batches(tier, [refs[0] for refs in by_hash.values()])):
        def consume(k, chunk, batch=batch):
            r = batch[k]
            if chunk is None:
                tier.counters["missing_chunks"] += 1
                raise Missing(f"remote chunk {r.hash} is gone (evicted or flushed)")
            try:
                tier.counters["bytes_fetched"] += local.fill_one(chunk(), r, dest)
            except CorruptData:
                tier.counters["corrupt_chunks"] += 1
                tier.client.delete(tier.keys.chunk(r.hash))
                raise
            tier.counters["chunks_fetched"] += 1

        hook = (lambda i=i: seams.FETCH_HOOK(i)) if seams.FETCH_HOOK else None
        direct.fetch_into(tier.client, [tier.keys.chunk(r.hash) for r in batch], [r.hash for r in batch],
                          consume, on_batch=hook)


def fetch_ahead(tier, refs):
    """Every distinct chunk as ``(hash, RemoteChunk)``, verified: pipelined ``GET`` in batches of about
    ``fetch_batch_bytes``, fetched one batch ahead on a helper thread (the network wait overlaps hashing and
    copying); the first failure ends the stream."""
    plan = batches(tier, refs)
    ahead: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def fetch_all() -> None:
        for i, b in enumerate(plan):
            if stop.is_set():
                return
            try:
                pipe = tier.client.pipeline(transaction=False)
                for r in b:
                    pipe.get(tier.keys.chunk(r.hash))
                values = pipe.execute()
                seams.FETCH_HOOK(i)
            except BaseException as exc:  # handed to the reader, which raises it
                ahead.put((b, exc))
                return
            ahead.put((b, values))

    helper = threading.Thread(target=fetch_all, name="kvshelf-remote-fetch", daemon=True)
    helper.start()
    try:
        for _ in plan:
            b, values = ahead.get()
            if isinstance(values, BaseException):
                raise values
            yield from verified(tier, b, values)
    finally:
        stop.set()
        while helper.is_alive() or not ahead.empty():  # never leave the helper blocked on a full queue
            try:
                ahead.get(timeout=0.05)
            except queue.Empty:
                pass

def verified(tier, batch, values):
    for r, value in zip(batch, values):
        if value is None:
            tier.counters["missing_chunks"] += 1
            raise Missing(f"remote chunk {r.hash} is gone (evicted or flushed)")
        try:
            chunk = local.RemoteChunk(value, r.hash, tier.ctx.keys)
        except EncryptionKeyError:  # sealed under a key this store does not hold (another store's, or forgotten):
            tier.counters["missing_chunks"] += 1  # a miss for this host, never deleted from the tier
            raise NotOurs(f"remote chunk {r.hash} is sealed under a data key this store does not hold") from None
        except CorruptData:
            tier.counters["corrupt_chunks"] += 1
            tier.client.delete(tier.keys.chunk(r.hash))
            raise
        tier.counters["chunks_fetched"] += 1
        tier.counters["bytes_fetched"] += len(value)
        yield r.hash, chunk


def good_copy(client, keys, hash_: str, counters: dict | None = None) -> local.RemoteChunk | None:
    """The shared tier's copy of one chunk, verified by its name, for ``repair`` (a local copy failed its hash):
    None when the tier does not hold it or its copy is damaged too (then deleted from the server, as a restore does,
    so the next publish of the content uploads fresh bytes). Network errors propagate (translated by the caller)."""
    value = client.get(keys.chunk(hash_))
    if value is None:
        return None
    try:
        chunk = local.RemoteChunk(value, hash_)
    except EncryptionKeyError:  # sealed: not a copy this caller can verify (nor damage to delete)
        return None
    except CorruptData:
        if counters is not None:
            counters["corrupt_chunks"] += 1
        client.delete(keys.chunk(hash_))
        return None
    if counters is not None:
        counters["chunks_fetched"] += 1
        counters["bytes_fetched"] += len(value)
    return chunk


__all__ = ["filler", "fill_direct", "fetch_ahead", "batches", "verified", "good_copy", "Missing"]
