"""Space: the store's budget and a full disk.

Belongs here: the reserve that keeps a delete possible on a full disk (``reserve.py``), removals that work on a full
disk (``full_disk.py``: ``FullDisk``, given ``gc``'s owner to free what is dead) and eviction to the ``max_bytes``
budget (``budget.py``: ``Budget``).

May import: ``store.context``, ``store.index``, ``store.liveness``, ``kvshelf.errors``. Never the façade.
"""
