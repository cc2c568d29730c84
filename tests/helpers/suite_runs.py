"""Throwaway pytest runs for the suite's self-tests: a generated test file in a temporary folder, run by a real
``python -m pytest`` subprocess under this project's own pytest configuration (``-c pyproject.toml``: its timeouts,
markers and warning filters) with the suite's plugin loaded by ``-p suite_guard``.

The child's environment starts clean of what the guards read (``CI``, ``KVSHELF_*``), so the parent run — CI or
not — never leaks into the child; each test sets what it checks. ``tool_stubs`` puts do-nothing executables named
like the tools ``.ci/run`` installs first on PATH, so a CI-mode child sees them on any machine (it only checks
they are there)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from suite_guard import TEST_TOOLS

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
HELPERS = TESTS / "helpers"
GUARD_ENV = ("CI", "KVSHELF_CURRENT_TEST", "KVSHELF_SKIP_REPORT", "KVSHELF_CI_TIME_LIMIT", "KVSHELF_CI_KILL_AFTER",
             "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "PYTHONPATH")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in GUARD_ENV}
    env["PYTHONPATH"] = str(HELPERS)
    env["COLUMNS"] = "250"  # the short summary's lines whole
    env.update(extra)
    return env


def tool_stubs(folder: Path) -> str:
    """A PATH whose first folder holds a stub of every tool ``.ci/run`` installs."""
    folder.mkdir(parents=True, exist_ok=True)
    for names in TEST_TOOLS:
        stub = folder / names[0]
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def pytest_command(folder: Path, *args: str) -> list[str]:
    """This project's configuration and the suite's plugin, node ids relative to ``folder``; no cache folder
    written into the repository."""
    return [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), f"--rootdir={folder}",
            "-p", "suite_guard", "-p", "no:cacheprovider", *args]


def run_pytest(folder: Path, *args: str, env: dict[str, str] | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess:
    """``pytest args...`` in ``folder``; stdout and stderr together in ``.stdout``."""
    return subprocess.run(pytest_command(folder, *args), cwd=folder, env=env or child_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)


__all__ = ["HELPERS", "REPO", "TESTS", "child_env", "pytest_command", "run_pytest", "tool_stubs", "write"]
