"""A real Prometheus (Debian's ``prometheus`` package; ``.ci/run`` installs it) scraping servers on 127.0.0.1.

Why a real one: a PromQL expression in docs/OPERATING.md that returns nothing (a vector match that cannot match,
a series that never exists) is only caught by the engine that evaluates it. Each instance has its own temporary
config and storage directory and scrapes every second; ``query`` is the HTTP API's instant query.

Ports: Prometheus cannot report a port the system picked, so a port is picked free and the process started; one
that exits (the port was taken meanwhile) is started again on another port.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from redis_servers import free_port

PROMETHEUS = shutil.which("prometheus")
START_TRIES = 10


def require_prometheus() -> None:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (.ci/run installs Debian's prometheus)")


class Prometheus:
    """One Prometheus process scraping ``targets`` (``host:port``) every second; stop with ``close()``."""

    def __init__(self, workdir: Path, targets: list[str], *, metrics_path: str = "/metrics"):
        require_prometheus()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: kvshelf\n"
            f"    metrics_path: {metrics_path}\n    static_configs:\n      - targets: {json.dumps(targets)}\n")
        self.log_path = self.workdir / "prometheus.log"
        for _ in range(START_TRIES):
            self.port = free_port()
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the process's lifetime
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=self._log, stderr=subprocess.STDOUT, cwd=str(self.workdir))
            if self._wait_ready():
                return
            self._log.close()
        raise AssertionError(f"prometheus did not start:\n{self.log_path.read_text(errors='replace')[-4000:]}")

    def _wait_ready(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5) as resp:
                    if resp.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.1)
        self.close()
        return False

    def query(self, expr: str) -> list[dict]:
        """The result of an instant query (a vector's samples; a scalar as one sample); raises on an API error."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=30) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", (expr, doc)
        data = doc["data"]
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]

    def wait_for(self, expr: str, predicate=bool, timeout: float = 120.0) -> list[dict]:
        """Query until ``predicate(result)`` holds (scrapes are every second; waiting on the data, not a clock)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if predicate(result) or time.monotonic() > deadline:
                return result
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["PROMETHEUS", "Prometheus", "require_prometheus"]
