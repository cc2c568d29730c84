"""The restore path: lease what a snapshot needs and read it straight into the final MLX arrays.

Belongs here: the restore calls as users make them (``restores.py``: ``Restores``, checked, with the lookup's retry
of ``restore_prefix``), the reads (``reader.py``: ``Reader``: whole, by id, batched, with quarantine on damage),
finding a snapshot's manifest (``snapshots.py``: ``Snapshots``), one chunk by hash (``chunks.py``), the direct read
engine (``direct.py``), the destinations it fills (``destinations.py``), the piece reads and the
virtual file over a pack range (``piece_reads.py``, ``virtualfile.py``) and huge-page destinations
(``hugepages.py``).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.save``, ``store.space``,
``store.liveness``, ``store.prefix``, ``store.index``, ``store.objects``, ``store.context``, ``store.identity``,
``store.inputs``, ``store.results``, ``store.base``; ``kvshelf.codecs``; and ``kvshelf.errors``. Never a room above
it, nor the façade."""
