"""Real server processes for the serving tests: ``kvshelf serve`` or plain ``mlx_lm.server`` on 127.0.0.1, a real
HTTP client (http.client), and waits on the server's own log lines (never on sleeps).

Ports: every server binds ``--port 0`` (the system picks a free port as it binds: no race with another process) and
prints ``kvshelf serve: listening on http://127.0.0.1:PORT``; ``Server.port`` is read from that line. Plain
``mlx_lm.server`` logs only the port it was asked for, so it runs through ``plain_mlx_server.py``, which prints the
same line and changes nothing else.

Why a log-driven harness: what a test must know (a write-behind finished, a prefix came from disk with N tokens,
a signal was seen) is exactly what the server logs, one line per event, so waiting on the line is waiting on the
event itself.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120.0
PREFIX_LINE = re.compile(r"kvshelf prefix source=(?P<source>\w+) cached=(?P<cached>\d+) prompt=(?P<prompt>\d+)")
SAVED_LINE = re.compile(r"kvshelf write-behind saved tokens=(?P<tokens>\d+)")
LISTENING_LINE = re.compile(r"kvshelf serve: listening on http://127\.0\.0\.1:(?P<port>\d+)")
PLAIN_SERVER = Path(__file__).resolve().parent / "plain_mlx_server.py"


def server_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               TRANSFORMERS_VERBOSITY="error")
    env.pop("KVSHELF_FAULT_ENOSPC_AFTER", None)
    env.update(extra or {})
    return env


class Server:
    """One server process. ``store=None`` runs plain ``mlx_lm.server`` (the reference without any store)."""

    def __init__(self, model_dir: Path, store: Path | None, log_path: Path, *, extra: tuple[str, ...] = (),
                 env: dict | None = None, launcher: Path | None = None):
        """``launcher``: a script run as ``python LAUNCHER serve ...`` instead of ``kvshelf serve`` (a fault
        injected into a real server, e.g. ``dying_serve.py``)."""
        self.port: int | None = None  # read from the listening line once the server bound its port
        self.log_path = Path(log_path)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0  # a reused log: ours only
        if store is None:
            cmd = [sys.executable, str(PLAIN_SERVER)]
        else:
            # write-behind lines are DEBUG (one INFO line per request): the tests wait on them
            entry = ["-m", "kvshelf.tools.cli"] if launcher is None else [str(launcher)]
            cmd = [sys.executable, *entry, "serve", "--store", str(store), "--kvshelf-log-level", "DEBUG"]
        cmd += ["--model", str(model_dir), "--host", "127.0.0.1", "--port", "0", *extra]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the process's lifetime
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=server_env(env),
                                     cwd=str(self.log_path.parent))
        self._wait_ready()

    # ------------------------------------------------------------------ process
    def _listening_port(self) -> int | None:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            found = LISTENING_LINE.search(f.read().decode(errors="replace"))
        return int(found["port"]) if found else None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if self.port is None:
                self.port = self._listening_port()
                if self.port is None:
                    time.sleep(0.05)
                    continue
            try:
                status, _ = self._request("GET", "/health", None, timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server did not come up:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str | re.Pattern, count: int = 1, timeout: float = 120.0) -> list[re.Match]:
        """Block until ``pattern`` matched ``count`` lines of the log (or the process died / timeout)."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            found = [m for m in (rx.search(line) for line in self.log().splitlines()) if m]
            if len(found) >= count:
                return found
            if self.proc.poll() is not None and len(found) < count:
                found = [m for m in (rx.search(line) for line in self.log().splitlines()) if m]
                if len(found) >= count:
                    return found
                raise AssertionError(f"server exited ({self.proc.returncode}) before {rx.pattern!r} x{count}:\n"
                                     f"{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {rx.pattern!r} x{count} in the log:\n{self.log()}")
            time.sleep(0.05)

    def prefix_lines(self) -> list[dict]:
        return [dict(m.groupdict(), cached=int(m["cached"]), prompt=int(m["prompt"]))
                for m in (PREFIX_LINE.search(line) for line in self.log().splitlines()) if m]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._log.close()

    def wait(self, timeout: float = 120.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._log.close()
        return rc

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, body: dict | None, timeout: float = 300):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def chat(self, messages: list[dict], max_tokens: int = 8) -> dict:
        """One non-streaming chat completion at temperature 0; returns {text, prompt_tokens, completion_tokens,
        cached_tokens}."""
        status, raw = self._request("POST", "/v1/chat/completions",
                                    {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0})
        assert status == 200, (status, raw, self.log())
        doc = json.loads(raw)
        usage = doc["usage"]
        return {"text": doc["choices"][0]["message"]["content"], "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def conversation(system: str, turns: list[str], replies: list[str]) -> list[dict]:
    """Messages: the system prompt, then user turns interleaved with the assistant replies given so far."""
    messages = [{"role": "system", "content": system}]
    for i, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def kvshelf_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvshelf.tools.cli", *args], env=server_env(), capture_output=True,
                          text=True, timeout=300, check=False)


__all__ = ["LISTENING_LINE", "PREFIX_LINE", "SAVED_LINE", "Server", "conversation", "kvshelf_cli", "server_env"]
