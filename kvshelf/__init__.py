"""kvshelf: persistence and a session store for MLX KV caches.

Subpackages, with dependencies pointing one way (tools -> store -> codecs -> latent_legos):

* :mod:`kvshelf.latent_legos` - the cache library (no I/O);
* :mod:`kvshelf.codecs` - caches <-> msgspec headers + tensors, and the portable snapshot file;
* :mod:`kvshelf.store` - the LMDB-indexed, content-addressed session store;
* :mod:`kvshelf.tools` - the ``kvshelf`` command line and offline jobs.

``open_store`` and ``Identity`` are re-exported lazily so that importing the cache library alone
does not open LMDB or import the store.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {"open_store": "kvshelf.store", "Identity": "kvshelf.store", "Store": "kvshelf.store"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvshelf' has no attribute {name!r}")


__all__ = ["open_store", "Identity", "Store", "__version__"]
