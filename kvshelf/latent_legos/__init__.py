"""kvshelf.latent_legos (being built)."""
