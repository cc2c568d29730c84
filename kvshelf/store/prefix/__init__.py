"""Prefix reuse: which stored snapshot shares the longest usable prefix with a prompt.

Belongs here: how a prefix is hashed at block boundaries (``hashing.py``), the prefix records every session's
current snapshot keeps in the index (``records.py``), what a search needs from where records live (``source.py``:
``RecordSource``), the index's own source (``index_records.py``) and the one prefix search (``search.py``), which
the shared tier runs over its Redis source (``remote/search.py``) instead of keeping a copy.

May import: ``store.index`` (the protocol, keys, schema), ``kvshelf.errors``. Never the façade.
"""
