"""Integrity: finding damage, hiding it, and rebuilding what was lost.

Belongs here: ``verify`` (``verify.py``, with its streamed counts in ``verify_counts.py``), ``gc`` (``gc.py``),
``rebuild_index`` from the packs' trailers (``rebuild.py``), quarantine of a snapshot whose bytes failed
verification (``quarantine.py``, which also marks the failing chunk copy bad), ``repair`` — rewrite from good
copies, drop what has none, reclaim (``repair.py``) —, tombstones (``tombs.py``) and layout v1's manifest files
(``legacy_v1.py``).

Collaborators: ``Quarantine``, ``Verifier``, ``Gc``, ``Rebuild``, ``Repair`` (given admin's repack as a callable); tombstones and v1 sealing are functions of the
index and byte store they are given.

May import: ``store.context``, ``store.index``, ``store.objects``, ``store.prefix``, ``store.liveness``,
``store.space``, ``store.restore.chunks`` (one chunk by hash, for the deep check). Never the façade.
"""
