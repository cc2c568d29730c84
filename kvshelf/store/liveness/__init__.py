"""Who may unlink what, and when: readers' leases, the reclaim that unlinks dead objects, and the locks around them.

Belongs here: the ledger (``ledger.py``: what a commit or a drop does to refcounts, totals, pack records, sessions
and prefix records, and ``object_live``, the one answer to "is this object still needed"), a handle's write
transactions (``transactions.py``: ``Transactions``) with its remembered uses
(``uses.py``: ``UseBook``), the one place objects are unlinked (``reclaim.py``: ``Reclaimer``), readers' leases
(``leases.py``: ``Leases``), dropping a snapshot for good (``removal.py``: ``Removal``), the lease files
(``lease_files.py``), object read locks for a full disk (``object_locks.py``), the per-process open lock
(``open_lock.py``), the removers' lock (``removers_lock.py``), the save gate (``save_gate.py``) and whether this
process may write the store at all (``access.py``: decided once at open, never by chmod-ing the store).

Lock order: the removers' lock, then the save gate, then the index's writer lock, then a handle's own lock; never
hold a handle's lock across an index transaction (transaction bodies take it).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.prefix``,
``store.index``, ``store.objects``, ``store.context``, ``store.identity``, ``store.inputs``, ``store.results``,
``store.base``; and ``kvshelf.errors``. Never a room above it, nor the façade."""
