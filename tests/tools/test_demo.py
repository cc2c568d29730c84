"""``kvshelf demo`` on a temporary store: the facts it shows hold, from the function and from the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvshelf.tools.demo import DECODE_TOKENS, NAMESPACE, SYSTEM_TOKENS, USER_TOKENS, run_demo


def test_demo_facts_on_a_fresh_store_then_a_rerun_from_the_command_line(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    lines: list[str] = []
    facts = run_demo(str(store_dir), out=lines.append)

    assert facts["store"] == str(store_dir)
    assert facts["logits_equal"] is True
    assert facts["batch_rows_exact"] is True
    # the new chat shares exactly the system prompt with the stored chats (its own turn starts elsewhere)
    assert facts["prefix_tokens"] == SYSTEM_TOKENS
    assert facts["restored_tokens"] == SYSTEM_TOKENS + USER_TOKENS[1] + DECODE_TOKENS
    assert facts["batch_lengths"] == [SYSTEM_TOKENS + n + DECODE_TOKENS for n in USER_TOKENS[2:]]
    assert facts["tokens_reused"] == facts["restored_tokens"] + facts["prefix_tokens"] + sum(facts["batch_lengths"])
    assert facts["bytes_reused"] > 0 and facts["bytes_written"] > 0
    assert facts["prefix_logits_max_abs_diff"] < 1e-3
    text = "\n".join(lines)
    assert "bit-identical to never stopping: True" in text
    assert f"reused {SYSTEM_TOKENS} of" in text
    assert "tokens reused" in text and "bytes written" in text

    # the module entry point, rerun on the same store: the demo replaces its own sessions and tells the same story
    env = dict(os.environ, PYTHONWARNINGS="error")
    done = subprocess.run([sys.executable, "-m", "kvshelf.tools.demo", "--store", str(store_dir)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "bit-identical to never stopping: True" in done.stdout
    assert f"reused {SYSTEM_TOKENS} of" in done.stdout

    from kvshelf import Identity, open_store  # only the demo namespace was written
    from kvshelf.tools.demo import MODEL

    identity = Identity("kvshelf-demo/synthetic-mla", config_fingerprint=repr(sorted(MODEL.items())),
                        tokenizer_hash="synthetic")
    with open_store(str(store_dir), identity=identity) as store:
        names = sorted(s.session_id for s in store.sessions(namespace=NAMESPACE))
        assert names == ["chat-0", "chat-1", "chat-2", "chat-3"]
        assert store.sessions(namespace="") == []
