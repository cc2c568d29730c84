"""kvshelf for mlx-lm users: mlx-lm's own caches persist as they are (codecs registered through the
``kvshelf.codecs`` entry point). This package depends on kvshelf's core and mlx-lm; the core never imports it."""
