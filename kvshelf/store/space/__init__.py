"""Space: the store's budget and a full disk.

Belongs here: the reserve that keeps a delete possible on a full disk (``reserve.py``), removals that work on a full
disk (``full_disk.py``: ``FullDisk``, given ``gc``'s owner to free what is dead) and eviction to the ``max_bytes``
budget (``budget.py``: ``Budget``), pins (``pins.py``: ``Pins``) and the user's calls that decide what is kept —
delete, pin, unpin (``keeping.py``: ``Keeping``).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.liveness``,
``store.prefix``, ``store.index``, ``store.objects``, ``store.context``, ``store.identity``, ``store.inputs``,
``store.results``, ``store.base``; and ``kvshelf.errors``. Never a room above it, nor the façade."""
