"""The save path: capture live caches, cut them into chunks, write the new ones as one pack, index it in one commit.

Belongs here: the saver (``saver.py``: ``Saver``), cutting tensors into chunk windows (``chunking.py``), reusing the hashes
of windows a cache proves unchanged (``hash_reuse.py``) and the background writer behind ``save_async``
(``background.py``).

May import: ``store.context``, ``store.index``, ``store.objects``, ``store.prefix`` (token arrays), ``store.liveness`` (the save gate,
reclaim), ``store.space`` (the budget), ``kvshelf.codecs``. Never the façade.
"""
