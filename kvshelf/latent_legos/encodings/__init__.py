"""Family encodings of latent state: affine and TurboQuant."""
