"""What every room of the store stands on: counted file durability (``syncs.py``: every fsync and index commit,
counted per thread, and ``ensure_dir``), per-thread work tallies (``tally.py``) and the test seams (``seams.py``).

Why a room of its own: the lowest rooms (``index``, ``objects``) need these, and nothing here may import any other
part of the store, so every room can import it without a circle.

May import (the room contract in pyproject.toml): the standard library only; it is the lowest layer.
Imported by every
room."""
