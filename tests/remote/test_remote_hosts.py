"""Two hosts, one shared tier: a session one process saved is found, restored and continued by another.

Each "host" is its own process with its own local store directory; they share only a real redis-server (or a
real 3-master cluster) started here on 127.0.0.1. Host A prefills a prompt on the synthetic MLA model and saves it;
host B looks up a longer prompt, restores the shared prefix from the remote tier (nothing of it is in B's local
store), decodes the continuation and reports its logits; they must be bit-identical to a from-scratch run here.
Run as a script, this file is the host worker (``python test_remote_hosts.py publish|continue ...``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis_servers import _cluster_servers, redis_cluster, redis_server  # noqa: F401  (fixtures)

PROMPT, EXTRA, CHUNK = 300, 6, 64


def _tokens():
    import mlx.core as mx

    return mx.random.randint(0, 256, (1, PROMPT + EXTRA), key=mx.random.key(7)).astype(mx.int32)


def _model():
    from kvshelf.testing.synthetic_model import SyntheticMLAModel

    return SyntheticMLAModel(num_layers=2, seed=0)


def _identity():
    from kvshelf import Identity

    return Identity("synthetic-mla", config_fingerprint="seed0", tokenizer_hash="bytes")


def _decode(model, caches, tokens, start):
    """Decode tokens[start:] one at a time on ``caches``; sha256 of every logit's bits."""
    import mlx.core as mx
    import numpy as np

    outs = [model(tokens[:, i:i + 1], caches) for i in range(start, tokens.shape[1])]
    logits = mx.concatenate(outs, axis=1)
    mx.eval(logits)
    return hashlib.sha256(np.array(logits).tobytes()).hexdigest()


def reference_digest() -> str:
    import mlx.core as mx

    model, tokens = _model(), _tokens()
    caches = model.make_caches()
    mx.eval(model(tokens[:, :PROMPT], caches))
    return _decode(model, caches, tokens, PROMPT)


def host(role: str, store_dir: str, remote: str, out: str) -> None:
    import mlx.core as mx

    from kvshelf import open_store

    model, tokens = _model(), _tokens()
    remote_arg = json.loads(remote) if remote.startswith("[") else remote
    with open_store(store_dir, _identity(), chunk_tokens=CHUNK, remote=remote_arg) as store:
        if role == "publish":
            caches = model.make_caches()
            mx.eval(model(tokens[:, :PROMPT], caches))
            store.save("chat-a", tokens[0, :PROMPT].tolist(), caches)
            assert store.tier.flush(30)
            result = {"stats": store.tier.stats()}
        else:
            prompt = tokens[0].tolist()
            assert store.sessions() == []  # nothing local: the hit can only come from the shared tier
            hit = store.lookup(prompt)
            restored = store.restore_prefix(prompt)
            result = {"hit": None if hit is None else [hit.session_id, hit.length],
                      "length": None if restored is None else restored.length,
                      "digest": None if restored is None else _decode(model, restored.caches, tokens,
                                                                       restored.length),
                      "local_after": [s.session_id for s in store.sessions()],
                      "verify": [f.kind for f in store.verify(deep=True)], "stats": store.tier.stats()}
    Path(out).write_text(json.dumps(result))


def _run(tmp_path: Path, role: str, store: str, remote) -> dict:
    out = tmp_path / f"{role}.json"
    tests = Path(__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests / "helpers"),
                                                       os.environ.get("PYTHONPATH", "")]))
    remote_arg = json.dumps(remote) if isinstance(remote, list) else remote
    proc = subprocess.run([sys.executable, __file__, role, str(tmp_path / store), remote_arg, str(out)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _two_hosts(tmp_path: Path, remote) -> None:
    a = _run(tmp_path, "publish", "host-a", remote)
    assert a["stats"]["published"] == 1 and a["stats"]["chunks_uploaded"] >= PROMPT // CHUNK
    b = _run(tmp_path, "continue", "host-b", remote)
    # the whole saved prompt is the usable prefix (the prompt goes on past it)
    assert b["hit"] == ["chat-a", PROMPT] and b["length"] == PROMPT
    assert b["stats"]["chunks_fetched"] >= PROMPT // CHUNK and b["stats"]["corrupt_chunks"] == 0
    assert b["digest"] == reference_digest()
    assert b["verify"] == [] and len(b["local_after"]) == 1 and b["local_after"][0].startswith("remote/")


def test_second_host_continues_first_hosts_session_bit_exact(tmp_path, redis_server):
    _two_hosts(tmp_path, redis_server.url)


@pytest.mark.slow
def test_two_hosts_through_a_cluster(tmp_path, redis_cluster):
    _two_hosts(tmp_path, redis_cluster.url)


@pytest.mark.slow
def test_two_hosts_through_cluster_seed_nodes(tmp_path, redis_cluster):
    _two_hosts(tmp_path, redis_cluster.seeds)


if __name__ == "__main__":
    host(*sys.argv[1:5])
