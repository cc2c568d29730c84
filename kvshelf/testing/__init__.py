"""kvshelf.testing: what a third party needs to test against kvshelf: the conformance suites of the two store seams
(``byte_store.py``, ``index_store.py``) and a small deterministic MLA model (``synthetic_model.py``).

May import anything in kvshelf; nothing in kvshelf imports it (``latent_legos`` forwards ``SyntheticMLAModel``
lazily for the public import path).
"""
