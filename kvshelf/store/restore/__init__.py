"""The restore path: lease what a snapshot needs and read it straight into the final MLX arrays.

Belongs here: the restore calls (``reader.py``: ``Reader``: whole, by id, batched, with quarantine on damage),
finding a snapshot's manifest (``snapshots.py``: ``Snapshots``), one chunk by hash (``chunks.py``), the direct read
engine (``direct.py``), the destinations it fills (``destinations.py``), the piece reads and the
virtual file over a pack range (``piece_reads.py``, ``virtualfile.py``) and huge-page destinations
(``hugepages.py``).

May import: ``store.context``, ``store.index``, ``store.objects``, ``store.prefix``, ``store.liveness`` (leases),
``store.integrity.quarantine`` (the ``Quarantine`` collaborator), ``kvshelf.codecs``.
No write transaction and no fsync happen on these paths. Never the façade.
"""
