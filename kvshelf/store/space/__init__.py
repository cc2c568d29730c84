"""Space: the store's budget and a full disk.

Belongs here: the reserve that keeps a delete possible on a full disk (``reserve.py``), removals that work on a full
disk (``full_disk.py``) and eviction to the ``max_bytes`` budget (``budget.py``).

May import: ``store.index``, ``store.liveness``, ``kvshelf.errors``. Never the façade.
"""
