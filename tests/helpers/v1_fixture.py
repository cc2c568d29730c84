"""The committed layout-v1 store (``tests/data/v1_store``, made by ``tests/data/make_v1_store.py``) and what it holds."""

from __future__ import annotations

import json
import os
import sys

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # tests/data
sys.path.insert(0, DATA)

from make_v1_store import state_checksum  # noqa: E402

from kvshelf import Identity  # noqa: E402

FIXTURE = os.path.join(DATA, "v1_store")
with open(os.path.join(DATA, "v1_store.expected.json")) as _f:
    EXPECTED = json.load(_f)
IDENTITY = Identity(*EXPECTED["identity"])

__all__ = ["DATA", "EXPECTED", "FIXTURE", "IDENTITY", "state_checksum"]
