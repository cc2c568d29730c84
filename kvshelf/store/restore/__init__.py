"""The restore path: lease what a snapshot needs and read it straight into the final MLX arrays.

Belongs here: the restore calls (``reader.py``: whole, by id, by prefix, batched, with quarantine on damage), the
direct read engine (``direct.py``), the destinations it fills (``destinations.py``), the piece reads and the
virtual file over a pack range (``piece_reads.py``, ``virtualfile.py``) and huge-page destinations
(``hugepages.py``).

May import: ``store.index``, ``store.objects``, ``store.prefix``, ``store.liveness`` (leases), ``kvshelf.codecs``.
No write transaction and no fsync happen on these paths. Never the façade.
"""
