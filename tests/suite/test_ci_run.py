"""``.ci/run`` on a copy of the repository's layout in a temporary folder (the script and a README, tool stubs on
PATH so it installs nothing): it runs the README's test command found under the README's own heading, says so and
exits 2 when there is none, and past its wall-clock limit prints the test that was running and exits 1 — whether
pytest stops at the interrupt or must be killed — and prints the host-feature skip report in every case."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from suite_runs import REPO, child_env, pytest_command, tool_stubs, write

HEADING = "# run the tests"


def layout(tmp_path: Path, test_command: str | None) -> Path:
    """The repository's README with its test command replaced (None: the README without its test heading)."""
    root = tmp_path / "repo"
    (root / ".ci").mkdir(parents=True)
    shutil.copy2(REPO / ".ci" / "run", root / ".ci" / "run")
    lines = (REPO / "README.md").read_text().splitlines()
    at = lines.index(HEADING)  # the README keeps this heading: .ci/run reads the line after it
    if test_command is None:
        del lines[at:at + 2]
    else:
        lines[at + 1] = test_command
    (root / "README.md").write_text("\n".join(lines) + "\n")
    return root


def ci_run(root: Path, tmp_path: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / ".ci" / "run")], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False,
                          env=child_env(PATH=tool_stubs(tmp_path / "bin"), **env))


def test_the_readme_test_command_runs_from_under_its_heading(tmp_path):
    root = layout(tmp_path, "echo the-test-command-ran CI=$CI")
    done = ci_run(root, tmp_path)
    assert done.returncode == 0, done.stdout
    assert "the-test-command-ran CI=true" in done.stdout  # CI mode unless the caller says otherwise
    assert "(no skip report: pytest did not finish)" in done.stdout


def test_a_readme_without_the_test_heading_is_reported_and_exits_2(tmp_path):
    root = layout(tmp_path, None)
    done = ci_run(root, tmp_path)
    assert done.returncode == 2, done.stdout
    assert "no test command found in README.md" in done.stdout, done.stdout


HUNG = """
    import signal
    import time

    def test_before():
        pass

    def test_hangs():
        {ignore}
        time.sleep(600)
"""


@pytest.mark.parametrize("stubborn", [False, True], ids=["interrupted", "killed"])
def test_past_the_wall_clock_limit_the_running_test_is_named(tmp_path, stubborn):
    """Interrupted: pytest stops at the SIGINT. Killed: the test ignores SIGINT (as a hang in C code would), so it
    is killed KVSHELF_CI_KILL_AFTER seconds later. Either way the running test is named and the run fails."""
    ignore = "signal.signal(signal.SIGINT, signal.SIG_IGN)" if stubborn else "pass"
    root = layout(tmp_path, " ".join(pytest_command(Path("."), "-q", "-o", "timeout=0", "test_hung.py")))
    write(root, "test_hung.py", HUNG.format(ignore=ignore))
    done = ci_run(root, tmp_path, CI="false", KVSHELF_CI_TIME_LIMIT="15", KVSHELF_CI_KILL_AFTER="2")
    out = done.stdout
    assert done.returncode == 1, out
    assert re.search(r"passed its wall-clock limit of 15 s \(KVSHELF_CI_TIME_LIMIT\) while running: "
                     r"test_hung\.py::test_hangs$", out, re.M), out
    assert "--- host-feature skips" in out, out
