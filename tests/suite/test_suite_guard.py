"""The suite's guards (``tests/helpers/suite_guard.py``), each shown on a real throwaway pytest run of a generated
test file: a hung test is stopped by its timeout and named while the run goes on; a slow test gets the longer
limit; under ``CI=true`` a missing test dependency stops the run naming it, and any skip but a declared host
feature's fails its test, while host-feature skips are allowed and reported (terminal and ``KVSHELF_SKIP_REPORT``).
The lists the guard checks are kept in step with pyproject's test extra and ``.ci/run``'s tools."""

from __future__ import annotations

import re
import tomllib

from suite_guard import TEST_MODULES, TEST_TOOLS
from suite_runs import REPO, child_env, run_pytest, tool_stubs, write

HUNG = """
    import time

    def test_hangs():
        time.sleep(600)

    def test_after_the_hung_one():
        pass
"""


def test_a_hung_test_is_stopped_by_its_timeout_with_its_name_printed_and_the_run_goes_on(tmp_path):
    write(tmp_path, "test_generated.py", HUNG)
    done = run_pytest(tmp_path, "-o", "timeout=2", "test_generated.py")
    out = done.stdout
    assert done.returncode == 1, out
    assert re.search(r"FAILED test_generated\.py::test_hangs - Failed: Timeout \(>2\.0s\) from pytest-timeout",
                     out), out
    assert "1 failed, 1 passed" in out, out  # the signal method: the hung test fails, the next one still runs


def test_a_slow_test_gets_the_slow_timeout_unless_it_sets_its_own(tmp_path):
    write(tmp_path, "test_generated.py", """
        import time
        import pytest

        @pytest.mark.slow
        def test_slow_hang():
            time.sleep(600)

        @pytest.mark.slow
        @pytest.mark.timeout(1)
        def test_slow_with_its_own_limit():
            time.sleep(600)
    """)
    done = run_pytest(tmp_path, "-o", "timeout=1", "-o", "slow_timeout=2", "test_generated.py")
    out = done.stdout
    assert done.returncode == 1, out
    assert re.search(r"FAILED test_generated\.py::test_slow_hang - Failed: Timeout \(>2\.0s\)", out), out
    assert re.search(r"FAILED test_generated\.py::test_slow_with_its_own_limit - Failed: Timeout \(>1\.0s\)", out), out


def test_ci_with_mlx_lm_unimportable_fails_the_run_naming_it(tmp_path):
    write(tmp_path, "test_generated.py", "def test_fine():\n    pass\n")
    blocker = tmp_path / "blocker"  # a sitecustomize that makes mlx_lm unimportable, as if uninstalled
    blocker.mkdir()
    write(blocker, "sitecustomize.py", "import sys\nsys.modules['mlx_lm'] = None\n")
    path = tool_stubs(tmp_path / "bin")
    control = run_pytest(tmp_path, "test_generated.py", env=child_env(CI="true", PATH=path))
    assert control.returncode == 0, control.stdout  # with mlx-lm there, the same CI run passes

    env = child_env(CI="true", PATH=path)
    env["PYTHONPATH"] = f"{blocker}:{env['PYTHONPATH']}"
    done = run_pytest(tmp_path, "test_generated.py", env=env)
    assert done.returncode == 1, done.stdout
    assert "python module mlx_lm (pip: mlx-lm, in the test extra)" in done.stdout, done.stdout
    assert "test_fine" not in done.stdout and "passed" not in done.stdout  # stopped before any test ran


SKIPS = """
    import pytest
    from host_features import HostFeatureMissing

    def test_plain_skip():
        pytest.skip("something is not installed")

    def test_importorskip():
        pytest.importorskip("kvshelf_no_such_module")

    @pytest.mark.skipif(True, reason="a condition")
    def test_skipif():
        pass

    @pytest.mark.host_feature("made-up")
    def test_host_feature_skip():
        pass

    @pytest.mark.host_feature("made-up")
    @pytest.mark.parametrize("n", [1, 2])
    def test_host_feature_skips_counted_per_test(n):
        pass

    def test_an_undeclared_host_feature():
        raise HostFeatureMissing("root", "pretended by the self-test")

    @pytest.mark.xfail(reason="known", strict=True)
    def test_xfail():
        assert False

    def test_passes():
        pass
"""
# a feature this machine never has, for the run only (the real probes depend on the machine)
CONFTEST = """
    import host_features
    host_features.FEATURES["made-up"] = lambda: "this self-test's made-up feature is never there"
"""
REPORT = ["host-feature skips: 3", "  3 x host feature made-up: this self-test's made-up feature is never there"]


def test_in_ci_only_a_declared_host_feature_may_skip_and_its_skips_are_reported(tmp_path):
    write(tmp_path, "test_generated.py", SKIPS)
    write(tmp_path, "conftest.py", CONFTEST)
    report = tmp_path / "skip-report"
    env = child_env(CI="true", PATH=tool_stubs(tmp_path / "bin"), KVSHELF_SKIP_REPORT=str(report))
    done = run_pytest(tmp_path, "-rA", "test_generated.py", env=env)
    out = done.stdout
    assert done.returncode == 1, out
    for name in ("test_plain_skip", "test_importorskip", "test_skipif", "test_an_undeclared_host_feature"):
        assert re.search(rf"(FAILED|ERROR) test_generated\.py::{name} - CI=true: this test skipped", out), (name, out)
    assert "add @pytest.mark.host_feature('root')" in out, out
    assert "3 failed, 1 passed, 3 skipped, 1 xfailed, 1 error" in out, out  # skipif: an error at setup
    assert report.read_text().splitlines() == REPORT
    assert "\n".join(REPORT) in out  # the terminal summary's section says the same

    report.unlink()
    outside = run_pytest(tmp_path, "test_generated.py", env=child_env(KVSHELF_SKIP_REPORT=str(report)))
    assert outside.returncode == 0, outside.stdout  # outside CI a skip is a skip
    assert "1 passed, 7 skipped, 1 xfailed" in outside.stdout, outside.stdout
    assert report.read_text().splitlines() == [*REPORT, "other skips (each a failure under CI=true): 4"]


def test_in_ci_a_module_level_skip_fails_its_collection(tmp_path):
    write(tmp_path, "test_generated.py", """
        import pytest
        pytest.importorskip("kvshelf_no_such_module")

        def test_never_collected():
            pass
    """)
    done = run_pytest(tmp_path, "test_generated.py", env=child_env(CI="true", PATH=tool_stubs(tmp_path / "bin")))
    assert done.returncode != 0, done.stdout
    assert "CI=true: collecting test_generated.py skipped, a failure in CI" in done.stdout, done.stdout
    assert "kvshelf_no_such_module" in done.stdout


def test_the_guards_lists_are_the_test_extra_and_the_tools_ci_installs():
    def dist(requirement: str) -> str:
        return re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert {dist(r) for r in extra} - {"pytest"} == {dist(d) for d in TEST_MODULES.values()}
    line = next(ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.startswith("for pair in "))
    pairs = dict(p.split(":") for p in line.removeprefix("for pair in ").split("; do")[0].split())
    assert pairs == {names[0]: package for names, package in TEST_TOOLS.items()}
