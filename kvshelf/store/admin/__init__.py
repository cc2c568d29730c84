"""What the offline tools use: listings, chunk re-encoding, in-place snapshot rewrites, repacking, the exclusive
hold and index replacement.

Belongs here: ``surface.py`` (``StoreAdmin``: the tools' calls, ``store.admin``), ``index_swap.py`` (``IndexSwap``:
the exclusive hold and index replacement) and ``repack.py``. Each call states how it stays
invisible to live readers (leases honoured, one write transaction per swap, the old copy unlinked only by reclaim).

May import: every other room of the store, never the façade. ``kvshelf.tools`` calls nothing else of the store.
"""
