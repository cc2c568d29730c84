"""Prefix reuse: which stored snapshot shares the longest usable prefix with a prompt.

Belongs here: how a prefix is hashed at block boundaries (``hashing.py``), the prefix records every session's
current snapshot keeps in the index (``records.py``), what a search needs from where records live (``source.py``:
``RecordSource``), the index's own source (``index_records.py``) and the one prefix search (``search.py``), which
the shared tier runs over its Redis source (``remote/search.py``) instead of keeping a copy; and the lookup calls
(``lookups.py``: ``Lookups``: ``lookup`` and ``explain_miss``, local first, then the shared tier).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.index``,
``store.objects``, ``store.context``, ``store.identity``, ``store.inputs``, ``store.results``, ``store.base``; and
``kvshelf.errors``. Never a room above it, nor the façade."""
