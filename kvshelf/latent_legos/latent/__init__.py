"""The latent (compressed MLA) caches: f32 ``MLACache``, ``EncodedLatentCache`` (affine / TurboQuant with the f32-first
shadow) and ``PagedLatentCache``, with their geometry, pages, column layout, encoded families and ``KvScheme``.

May import: the row contract beside this package (``contracts``, ``rows``, ``justified``, ``cache_parts``,
``formats``) and ``latent_legos.encodings``. No I/O.
"""
