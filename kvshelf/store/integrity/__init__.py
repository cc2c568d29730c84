"""Integrity: finding damage, hiding it, and rebuilding what was lost.

Belongs here: ``verify`` (``verify.py``, with its streamed counts in ``verify_counts.py``), ``gc`` (``gc.py``),
``rebuild_index`` from the packs' trailers (``rebuild.py``), quarantine of a snapshot whose bytes failed
verification (``quarantine.py``, which also marks the failing chunk copy bad), ``repair`` — rewrite from good
copies, drop what has none, reclaim (``repair.py``) —, tombstones (``tombs.py``) and layout v1's manifest files
(``legacy_v1.py``).

Collaborators: ``Quarantine``, ``Verifier``, ``Gc``, ``Rebuild``, ``Repair`` (given admin's repack as a callable); tombstones and v1 sealing are functions of the
index and byte store they are given.

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.restore``,
``store.save``, ``store.space``, ``store.liveness``, ``store.prefix``, ``store.index``, ``store.objects``,
``store.context``, ``store.identity``, ``store.inputs``, ``store.results``, ``store.base``; and ``kvshelf.errors``.
Never a room above it, nor the façade."""
