"""kvshelf.store (being built)."""
