"""kvshelf.codecs (being built)."""
