"""Who may unlink what, and when: readers' leases, the reclaim that unlinks dead objects, and the locks around them.

Belongs here: a handle's write transactions with its remembered uses and the one place objects are unlinked
(``leasing.py``), the lease files (``lease_files.py``), object read locks for a full disk (``object_locks.py``), the
per-process open lock (``open_lock.py``) and the removers' lock (``removers_lock.py``).

Lock order: the removers' lock, then the save gate, then the index's writer lock, then a handle's own lock; never
hold a handle's lock across an index transaction (transaction bodies take it).

May import: ``store.index``, ``store.objects``, ``kvshelf.errors``. Never the façade.
"""
