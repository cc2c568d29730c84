"""Shared test settings: the hypothesis ``ci`` profile (derandomized, no deadline), ``tests/helpers`` on the
import path, and the suite's guards (``helpers/suite_guard.py``: timeouts, host-feature skips, CI's strictness).

Tests live in folders that mirror the package (``store/``, ``codecs/``, ``legos/`` ...) and import their shared,
non-test modules (``store_cases``, ``tools_data``, ``serve_harness`` ...) from ``tests/helpers`` by their plain names;
this is the one place that makes that work. Subprocess scripts that import helpers put the same folder on their own
path (pytest's conftest does not run in them). Test files need unique basenames: pytest's default ("prepend") import
mode imports each one by its basename from its own folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

pytest_plugins = ["suite_guard"]

settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
