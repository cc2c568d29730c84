"""What the offline tools use: listings, chunk re-encoding, in-place snapshot rewrites, repacking, the exclusive
hold and index replacement.

Belongs here: ``surface.py`` (the tools' calls on a store) and ``repack.py``. Each call states how it stays
invisible to live readers (leases honoured, one write transaction per swap, the old copy unlinked only by reclaim).

May import: every other room of the store. ``kvshelf.tools`` calls nothing else of the store.
"""
