"""kvshelf.tools (being built)."""
