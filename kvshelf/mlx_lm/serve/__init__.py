"""``kvshelf serve``: mlx-lm's own server with its prompt cache backed by a kvshelf store (``server.py``,
``prompt_cache.py``) and the model identity it saves under (``model_identity.py``).
"""
