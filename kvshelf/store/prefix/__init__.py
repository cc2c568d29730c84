"""Prefix reuse: which stored snapshot shares the longest usable prefix with a prompt.

Belongs here: how a prefix is hashed at block boundaries (``hashing.py``), the prefix records every session's
current snapshot keeps in the index (``records.py``) and the one prefix search over them (``search.py``).

May import: ``store.index`` (the protocol, keys, schema), ``kvshelf.errors``. Never the façade.
"""
