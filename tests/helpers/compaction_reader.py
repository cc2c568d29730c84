"""A serving-process stand-in for the compaction tests: restores every session (whole, prefix, batch) in a loop and
checks each read bit for bit against what it read before compaction started.

``python compaction_reader.py STORE READY_FILE STOP_FILE RESULT_FILE``: writes READY_FILE once its baseline is taken,
loops until STOP_FILE exists (after each loop RESULT_FILE with suffix ``.loops`` holds the count so far), then writes
``{"loops": n, "errors": [...]}`` to RESULT_FILE.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import xxhash  # noqa: E402
from tools_data import MODEL, reads  # noqa: E402

from kvshelf import open_store  # noqa: E402


def digest(caches) -> str:
    h = xxhash.xxh3_128()
    for array in reads(caches):
        h.update(array.tobytes())
    return h.hexdigest()


def observe(store, sessions) -> dict[str, str]:
    out = {}
    for s in sessions:
        r = store.restore(s)
        out[s] = digest(r.caches)
        prefix = store.restore_prefix(list(r.tokens[:50]) + [7, 7, 7])
        out[s + "@prefix"] = "none" if prefix is None else f"{prefix.length}"
    batch = store.restore_batch(["s-mla", "s-mla-copy"])
    out["batch"] = f"{batch.lengths}"
    return out


def main() -> None:
    root, ready, stop, result = (Path(a) for a in sys.argv[1:5])
    errors, loops = [], 0
    with open_store(root, identity=MODEL, chunk_tokens=32) as store:
        sessions = sorted(s.session_id for s in store.sessions(namespace=""))
        baseline = observe(store, sessions)
        ready.write_text(json.dumps(baseline))
        while not stop.exists():
            try:
                now = observe(store, sessions)
                if now != baseline:
                    errors.append({k: (baseline.get(k), v) for k, v in now.items() if baseline.get(k) != v})
            except Exception:  # noqa: BLE001 - every failure is what the test looks for
                errors.append(traceback.format_exc())
            loops += 1
            progress = result.with_suffix(".loops.tmp")
            progress.write_text(str(loops))
            progress.replace(result.with_suffix(".loops"))  # the test waits on this count, not on the clock
    result.write_text(json.dumps({"loops": loops, "errors": errors[:5], "n_errors": len(errors)}))


if __name__ == "__main__":
    main()
