"""A restore's destinations are faulted in huge pages where the kernel offers them (``kvshelf.store.restore.hugepages``).

Counted, not timed: the process's ``AnonHugePages`` (``/proc/self/smaps_rollup``) before and after restoring a
64 MiB cache in a fresh subprocess. With THP in ``madvise`` mode (this machine's and Debian's default) huge pages
appear only where they were asked for, so the same restore with ``KVSHELF_NO_HUGEPAGES=1`` is the baseline: it
gets none. Skipped, with the reason, where the kernel has no THP or it is ``never``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from host_features import thp_mode

SCRIPT = """
import json, sys
sys.path[:0] = [{helpers!r}, {repo!r}]
import mlx.core as mx
from kvshelf.latent_legos.kv import KVCache
from store_cases import open_test_store, token_ids

def huge_kib():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0

caches = []
for layer in range(4):
    c = KVCache()
    k = mx.random.normal((1, 8, 2048, 128), key=mx.random.key(layer))  # 8 MiB per plane, f32
    c.update_and_fetch(k, -k)
    caches.append(c)
with open_test_store({root!r}) as store:
    store.save("a", token_ids(2048), caches)
    del caches
    before = huge_kib()
    r = store.restore("a")
    mx.eval([a for c in r.caches for a in (c.keys, c.values)])
    after = huge_kib()
print(json.dumps({{"before": before, "after": after}}))
"""


def _run(tmp_path: Path, name: str, env: dict) -> dict:
    tests = Path(__file__).parents[1]
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT.format(helpers=str(tests / "helpers"), repo=str(tests.parent), root=str(tmp_path / name)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.host_feature("hugepages")  # THP "madvise" or "always"
def test_restore_destinations_get_huge_pages(tmp_path):
    mode = thp_mode()
    advised = _run(tmp_path, "advised", {"KVSHELF_NO_HUGEPAGES": "0"})
    gained = advised["after"] - advised["before"]
    assert gained >= 32 << 10, advised  # at least half of the 64 MiB restored came in 2 MiB pages
    if mode == "madvise":  # huge pages only where asked for: without the advice, none
        plain = _run(tmp_path, "plain", {"KVSHELF_NO_HUGEPAGES": "1"})
        assert plain["after"] - plain["before"] < 4 << 10, plain
