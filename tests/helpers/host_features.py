"""The host features some tests need: root, mounting a tmpfs, strace that may trace, transparent huge pages, a PID
namespace of their own.

Why one marker: a test that skips because the machine lacks something must say so where a reader and CI can see
it. Such a test carries ``@pytest.mark.host_feature("root")`` (several names allowed, markers stack); the suite's
plugin (``suite_guard.py``) probes each named feature before the test runs and skips it with the probe's reason.
A test that only finds out while running (``strace_path()`` in ``traced.py``) calls ``need("strace")``. Either
way the skip is a ``HostFeatureMissing``: in CI (``CI=true``) it is the only skip allowed, it must name a feature
its test declares, and it is counted in the skip report ``.ci/run`` prints. Tools that ``.ci/run`` installs
(redis-server, chromium, ...) are not host features: in CI a missing one fails the run at its start.

Each probe runs once per process (cached); it returns None when the feature is there, else why it is not.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class HostFeatureMissing(pytest.skip.Exception):
    """A skip for a host feature this machine lacks; ``feature`` names it (one of ``FEATURES``)."""

    __module__ = "builtins"  # pytest's skip lines say "HostFeatureMissing: ...", as they say "Skipped: ..."

    def __init__(self, feature: str, why: str):
        super().__init__(f"host feature {feature}: {why}", _use_item_location=True)
        self.feature = feature


def _root() -> str | None:
    return None if os.geteuid() == 0 else "needs root (CI runs as root)"


def _mount() -> str | None:
    if (why := _root()) is not None:
        return f"mounting a tmpfs {why}"
    with tempfile.TemporaryDirectory(prefix="kvshelf-mount-probe-") as mnt:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", mnt],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"mount -t tmpfs refused ({done.stderr.strip()[:200] or done.returncode})"
        subprocess.run(["umount", "-l", mnt], check=False)
    return None


def _strace() -> str | None:
    path = shutil.which("strace")
    if path is None:
        return "strace is not installed (apt-get install -y strace; .ci/run installs it)"
    probe = subprocess.run([path, "-f", "-o", os.devnull, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"strace cannot trace here (ptrace refused?): {probe.stderr.strip()[:200]}"
    return None


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or "" where there is none."""
    try:
        text = THP.read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else ""


def _hugepages() -> str | None:
    mode = thp_mode()
    return None if mode in ("madvise", "always") else f"transparent huge pages are {mode or 'absent'} on this kernel"


def _pid_namespace() -> str | None:
    path = shutil.which("unshare")
    if path is None:
        return "unshare is not installed (util-linux)"
    probe = subprocess.run([path, "--pid", "--fork", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"unshare --pid is refused here: {probe.stderr.strip()[:200]}"
    return None


FEATURES: dict[str, Callable[[], str | None]] = {
    "root": _root,
    "mount": _mount,  # root, and the kernel lets it mount a tmpfs (a container may not)
    "strace": _strace,
    "hugepages": _hugepages,
    "pid-namespace": _pid_namespace,
}


@functools.cache
def missing(feature: str) -> str | None:
    """Why ``feature`` is missing on this machine, or None when it is there."""
    if feature not in FEATURES:
        raise ValueError(f"unknown host feature {feature!r}; known: {', '.join(FEATURES)}")
    return FEATURES[feature]()


def need(feature: str) -> None:
    """Skip the running test (``HostFeatureMissing``) when this machine lacks ``feature``."""
    why = missing(feature)
    if why is not None:
        raise HostFeatureMissing(feature, why)


__all__ = ["FEATURES", "HostFeatureMissing", "missing", "need", "thp_mode"]
