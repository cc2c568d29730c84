"""kvshelf.tools: the ``kvshelf`` command line and the offline jobs behind it.

``cli.py`` (with ``cli_args.py``) parses and dispatches every verb; ``admin.py`` is the operators' view of a store
(every identity and namespace at once); ``paths.py`` says where the embedded default store lives; ``render.py`` draws tables; ``transfer.py``
exports and imports sessions (kvshelf snapshot files, mlx-lm prompt-cache files); ``compaction.py`` plans and runs
``kvshelf compact`` with ``rewriting.py`` (in-place chunk rewrites) and ``densify.py`` (dropping dead paged blocks);
``watcher.py`` ingests an inbox directory; ``demo.py`` is ``kvshelf demo``; ``lmdb_files.py`` names LMDB's files.

The top of the package's arrows: tools may import the store, the codecs, the cache library and (for mlx-lm
verbs) ``kvshelf.mlx_lm``; nothing imports the tools.
"""
