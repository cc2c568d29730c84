"""kvshelf's latent legos inside mlx-lm's MLA models: ``make_prompt_cache`` (``cache.py``), the faces mlx-lm's attention
code runs on (``faces.py``) and glm_moe_dsa's indexer keys (``dsa.py``).
"""
