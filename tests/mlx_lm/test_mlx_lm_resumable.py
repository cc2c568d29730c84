"""``resumable_generate`` across real process deaths: SIGKILLed mid-way (after a checkpoint is durable, or at
chosen points inside a checkpoint's write), then run again, it gives exactly the tokens and text of a run that was
never interrupted — resuming from the last durable checkpoint or starting over, never from a torn one — and the store
is clean (``gc`` then ``verify --deep``) afterwards.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import generation_worker as worker
from serve_harness import kvshelf_cli, server_env
from tiny_model_dir import make_model_dir

from kvshelf import open_store
from kvshelf.mlx_lm import model_identity
from kvshelf.store.generations import NAMESPACE_PREFIX

WORKER = Path(worker.__file__)
CHECKPOINT = re.compile(r"kvshelf generation checkpoint tokens=\d+ generated=(\d+)")
RESUME = re.compile(r"kvshelf resume from=(\d+) of max_tokens=(\d+)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


@pytest.fixture(scope="module")
def uninterrupted(model, tmp_path_factory):
    out = run(model, tmp_path_factory.mktemp("reference") / "store")
    assert len(out["tokens"]) == worker.MAX_TOKENS
    return out


def run(model, store, *extra: str) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), str(model), str(store), *extra], env=server_env(),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), log=done.stderr)


def checkpoints(model, store) -> list:
    with open_store(store, identity=model_identity(model)) as s:
        return [x for x in s.sessions() if x.namespace.startswith(NAMESPACE_PREFIX)]


def assert_clean(store) -> None:
    gc = kvshelf_cli("gc", "--store", str(store))
    assert gc.returncode == 0, gc.stdout + gc.stderr
    verify = kvshelf_cli("verify", "--deep", "--store", str(store), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_killed_after_a_checkpoint_then_run_again_gives_identical_output(model, uninterrupted, tmp_path):
    store = tmp_path / "store"
    with subprocess.Popen([sys.executable, str(WORKER), str(model), str(store)], env=server_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        try:
            for line in proc.stderr:  # wait on the durable checkpoint's log line, then kill
                m = CHECKPOINT.search(line)
                if m and int(m[1]) >= 2 * worker.EVERY:
                    break
            else:
                raise AssertionError("the worker ended without logging a checkpoint")
        finally:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert checkpoints(model, store)
    again = run(model, store)
    assert (again["tokens"], again["text"]) == (uninterrupted["tokens"], uninterrupted["text"])
    resumed = [int(g) for g, _ in RESUME.findall(again["log"])]
    assert resumed and resumed[0] >= 2 * worker.EVERY
    assert checkpoints(model, store) == []  # completed: its checkpoints were dropped
    assert_clean(store)


# After the first checkpoint (3 durable steps: pack fsync, directory fsync, index commit), the second checkpoint's
# own steps: 4 before its pack is renamed, 5 renamed but not indexed, 6 indexed (the first not yet deleted),
# 7 the first deleted (its pack not yet unlinked).
@pytest.mark.parametrize("die_at", [4, 5, 6, 7])
def test_a_kill_inside_a_checkpoint_write_resumes_from_a_whole_checkpoint_or_starts_over(model, uninterrupted,
                                                                                        tmp_path, die_at):
    store = tmp_path / "store"
    died = subprocess.run([sys.executable, str(WORKER), str(model), str(store), "--die-at-sync", str(die_at)],
                          env=server_env(), capture_output=True, text=True, timeout=600, check=False)
    assert died.returncode == -signal.SIGKILL, died.stderr
    durable = [int(g) for g in CHECKPOINT.findall(died.stderr)]
    left = sorted(s.length for s in checkpoints(model, store))
    assert left, "the first checkpoint was durable before the kill"
    again = run(model, store)
    assert (again["tokens"], again["text"]) == (uninterrupted["tokens"], uninterrupted["text"])
    resumed = [int(g) for g, _ in RESUME.findall(again["log"])]
    assert resumed and resumed[0] in {worker.EVERY, 2 * worker.EVERY}
    assert resumed[0] >= max(durable, default=0)
    assert checkpoints(model, store) == []
    assert_clean(store)
