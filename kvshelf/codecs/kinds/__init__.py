"""One codec module per cache family: key/value caches with a token axis (``kv.py``) and without (``kv_state.py``),
the latent caches (``mla.py``, ``encoded.py``, ``paged.py``) and what the latent ones share (``latent_common.py``).

May import: ``kvshelf.codecs`` (the codec base, headers, validation) and ``kvshelf.latent_legos``. No storage.
"""
