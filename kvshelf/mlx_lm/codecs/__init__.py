"""Codecs of mlx-lm's own cache classes: key/value (``kv.py``), recurrent and list state (``state.py``,
``cache_list.py``), the latent faces (``latent.py``) and their shared base (``base.py``). Registered through the
``kvshelf.codecs`` entry point (``kvshelf.mlx_lm.plugin``); the core never imports them.
"""
